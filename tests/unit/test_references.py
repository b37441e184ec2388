"""Words that stay true (issue 58): every repository path and every ``rlmega.module.name`` that the code, tests,
tools, configs or docs name exists.

A path is ``rlmega/``, ``tests/``, ``tools/``, ``docs/``, ``configs/``, ``docker/`` or ``examples/`` followed by a
file or folder (a glob must match something). A dotted name is ``rlmega.a.b...``: its longest prefix must be a
module or package of the repository, and the next name must appear in that module's source (a function, class,
constant or import; deeper attributes are not followed). What a file names on purpose although it does not exist
(a bad input a test feeds, an example file name, a removed file named with the commit that keeps it) is in
INTENTIONAL, with why. A package's docstring that lists its files (``router.py  EngineRouter: ...``) lists files
that are there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (
    "rlmega/**/*.py",
    "tests/**/*.py",
    "tools/**/*.py",
    "tools/**/*.md",
    "tools/**/*.sh",
    "tools/**/*.sbatch",
    "docs/**/*.md",
    "configs/**/*.yaml",
    "docker/**/*",
    ".ci/*",
    "README.md",
    "Makefile",
)
_PATH = re.compile(
    r"(?<![\w./-])((?:rlmega|tests|tools|docs|configs|docker|examples)/[\w.*/-]*[\w*])"
)
_DOTTED = re.compile(r"(?<![\w./-])(rlmega(?:\.[A-Za-z_]\w*)+)")

INTENTIONAL = {
    # file names, not modules: the Slurm batch script (tools/slurm/rlmega.sbatch), a package's own file
    "rlmega.sbatch",
    "rlmega.__file__",
    # the serialised batch's format tag (rlmega/data/rollout_batch.py), a string, not a module
    "rlmega.RolloutBatch",
    # torchrun_group's key-value store layout, described in its docstring
    "rlmega/cmd/k",
    "rlmega/res/k/RANK",
    # examples of a user's own config in docs and the batch script's usage line
    "configs/my_gpu.yaml",
    "configs/x.yaml",
    # bad inputs the tests feed on purpose: reward functions and modules that do not exist, a dotted path's typo
    "rlmega.rewards.math.scroe",
    "rlmega.nope.f",
    "rlmega.rewards.nope.score",
    "rlmega.rewards.arithmetic.scor",
    "rlmega/0",
    # history: removed files named with the commit that keeps them (docs/deepseek_v3_megatron.md,
    # docs/architecture.md's account of how the import circles were broken)
    "tools/spikes/deepseek_v3_megatron_parity.py",
    "rlmega/workers",
}


def scanned_files() -> list[Path]:
    """Every file of SCANNED but this one (it names missing things on purpose) and what runs/ holds."""
    return sorted(
        {
            p
            for pattern in SCANNED
            for p in ROOT.glob(pattern)
            if p.is_file()
            and p != Path(__file__)
            and "__pycache__" not in p.parts
            and "runs" not in p.relative_to(ROOT).parts
        }
    )


def dotted_name_exists(dotted: str) -> bool:
    """``rlmega.a.b.c``: the longest prefix that is a module or package, and the next name in its source."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.is_file():
                rest = parts[k:]
                return (
                    not rest
                    or rest[0].startswith("__")
                    or (base / rest[0]).exists()
                    or re.search(rf"\b{re.escape(rest[0])}\b", file.read_text()) is not None
                )
    return False


def missing_references(files: list[Path]) -> list[str]:
    """``file:line: name`` for each path or dotted name that does not exist (INTENTIONAL left out)."""
    out = []
    for file in files:
        try:
            text = file.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        rel = file.relative_to(ROOT)
        for number, line in enumerate(text.splitlines(), 1):
            for m in _PATH.finditer(line):
                path = m.group(1).rstrip(".")
                found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
                if not found and path not in INTENTIONAL:
                    out.append(f"{rel}:{number}: {path}")
            for m in _DOTTED.finditer(line):
                name = m.group(1).rstrip(".")
                if not dotted_name_exists(name) and name not in INTENTIONAL:
                    out.append(f"{rel}:{number}: {name}")
    return out


def test_every_named_path_and_module_exists():
    files = scanned_files()
    assert len(files) > 300  # the scan reaches the repository (code, tests, docs, configs)
    missing = missing_references(files)
    assert not missing, (
        "named but missing (fix the reference, or add it to INTENTIONAL with why):\n"
        + "\n".join(missing)
    )


def unlisted_package_files(root: Path) -> list[str]:
    """``package/__init__.py: name.py`` for each bare file name a package's docstring gives that the package lacks."""
    out = []
    for init in sorted(root.glob("rlmega/**/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in sorted(set(re.findall(r"(?<![\w/.-])([a-z_][a-z0-9_]*\.py)\b", doc))):
            if not (init.parent / name).exists():
                out.append(f"{init.relative_to(root)}: {name}")
    return out


def test_every_file_a_package_lists_is_there():
    assert unlisted_package_files(ROOT) == []


def test_the_scan_finds_a_stale_reference(tmp_path):
    """What the scan catches, as the stale words of issue 58 were: a moved module, a removed test, a module name."""
    doc = ROOT / "docs" / "_stale_probe.md"
    doc.write_text(
        "see rlmega/megatron/batching.py and tests/unit/test_lora.py; rlmega.megatron.engine.plan and "
        "rlmega.fsdp.runtime; rlmega/rollout/rollout.py and rlmega.rollout.rollout.RolloutWorker exist\n"
    )
    try:
        assert missing_references([doc]) == [
            "docs/_stale_probe.md:1: rlmega/megatron/batching.py",
            "docs/_stale_probe.md:1: tests/unit/test_lora.py",
            "docs/_stale_probe.md:1: rlmega.megatron.engine.plan",
            "docs/_stale_probe.md:1: rlmega.fsdp.runtime",
        ]
    finally:
        doc.unlink()
