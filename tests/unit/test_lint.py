"""The tree passes ruff with the repository's ruff.toml: what `make test` checks before pytest, checked
here too so that the lint rule holds when pytest is run directly."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str] | None:
    """The command that runs ruff: the dev extra's (pinned in setup.py) in this interpreter's
    environment, else one on PATH; None when there is none."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


def test_the_tree_passes_ruff():
    ruff = _ruff()
    if ruff is None:
        pytest.skip(
            "ruff is not installed: it comes with the dev extra (pip install -e '.[dev]', or make test)"
        )
    # --no-cache: a test run leaves no .ruff_cache in the checkout.
    proc = subprocess.run(
        [*ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(
            f"`ruff check .` failed (exit {proc.returncode}); fix the code, or see ruff.toml for the "
            f"rules:\n{proc.stdout}{proc.stderr}",
            pytrace=False,
        )


def test_the_tree_is_as_ruff_format_writes_it():
    """Lines of code at most 100 characters, as ruff format breaks them (ruff.toml says why)."""
    ruff = _ruff()
    if ruff is None:
        pytest.skip(
            "ruff is not installed: it comes with the dev extra (pip install -e '.[dev]', or make test)"
        )
    proc = subprocess.run(
        [*ruff, "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"`ruff format --check .` failed (exit {proc.returncode}): run `ruff format .`\n"
            f"{proc.stdout}{proc.stderr}",
            pytrace=False,
        )
