"""What the e2e tests share: the tiny model, running `rlmega train` and reading its metrics, the kill -9 of a run,
and the processes a run leaves behind.

The helpers are plain functions: a test module imports them (``from conftest import run_ok, read_metrics``; pytest
puts tests/e2e on sys.path). ``pytest_collect_file`` below makes ``conftest`` name this module while an e2e
test module is imported, even when another folder's conftest.py was loaded since (tests/gpu has one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# torchrun whose stores listen on loopback only (rlmega/launch/torchrun.py), as the README launches it
TORCHRUN = [sys.executable, "-m", "rlmega.launch.torchrun", "--standalone", "--nproc-per-node"]
_THIS = sys.modules[__name__]


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.parent == Path(__file__).parent:
        sys.modules["conftest"] = _THIS  # what ``from conftest import ...`` in that module finds
    return None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen2 every `rlmega train` test runs (hidden 256, 4 heads, 2 KV heads, 4 layers, seed 0), made once
    a session. Read-only: a test that changes weights copies it first."""
    from rlmega.demo.tiny_model import make_tiny_model

    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny_model") / "tiny",
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            num_layers=4,
            seed=0,
        )
    )


def env(**extra) -> dict:
    """The environment of a run: this one, with Python's warnings off (they bury a failure's stderr)."""
    return {**os.environ, "PYTHONWARNINGS": "ignore", **extra}


def run_ok(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; it must exit 0 (else its output's tails are the failure)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def read_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl, one dict a step."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def same_numbers(a: dict, b: dict) -> dict:
    """The metrics of two runs that differ (times aside): {name: (a, b)}."""
    timing = {"tokens_per_s", "engine_busy_fraction", "trainer_busy_fraction"}
    return {
        k: (a.get(k), b.get(k))
        for k in a.keys() | b.keys()
        if not k.startswith("time") and k not in timing and a.get(k) != b.get(k)
    }


def with_fault(cmd: list[str], fault: str, n: int) -> list[str]:
    """``python -m rlmega.train ...`` as ``python -m rlmega.testing.faults FAULT N ...``: the same run with one
    fault (``hang-after N``: the driver blocks right after logging step N; ``skip-sync N``: that sync sends nothing)."""
    assert cmd[1:3] == ["-m", "rlmega.train"], cmd[:3]
    return [cmd[0], "-m", "rlmega.testing.faults", fault, str(n), *cmd[3:]]


def steps_logged(run_dir, n: int) -> Callable[[], bool]:
    """True once the run has logged ``n`` steps."""

    def when() -> bool:
        return (Path(run_dir) / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= n

    when.what = f"step {n}"
    return when


def checkpointed(run_dir) -> Callable[[], bool]:
    """True once the run has written its first checkpoint."""

    def when() -> bool:
        return (Path(run_dir) / "checkpoints" / "latest").exists()

    when.what = "a checkpoint"
    return when


def kill_9(
    cmd: list[str],
    when: Callable[[], bool],
    *,
    tag: str | None = None,
    stdout=subprocess.DEVNULL,
    timeout: float = 500,
    poll_s: float = 0.5,
    while_waiting: Callable[[], None] | None = None,
) -> None:
    """Start ``cmd`` (a session of its own, from the repository root), wait until ``when()``, then SIGKILL its
    whole process group: the driver dies with no chance to clean up. ``tag`` goes into the environment of every
    process the run starts (:func:`tagged_processes` finds them); ``while_waiting`` is called at each poll."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env(**({"RLMEGA_TEST_TAG": tag} if tag else {})),
    )
    deadline = time.monotonic() + timeout
    try:
        while not when():
            what = getattr(when, "what", "the kill")
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"the run stalled before {what} ({timeout:.0f} s)"
            if while_waiting:
                while_waiting()
            time.sleep(poll_s)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tagged_processes(tag: str) -> set[int]:
    """Processes whose environment carries ``tag``: the run's driver, Ray and every worker it
    started inherit it, and nothing else on the machine has it."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and f"RLMEGA_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes()
            ):
                found.add(int(proc.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def named_processes(tag: str, name: str) -> list[int]:
    """The run's processes whose command line holds ``name`` (a Ray actor's title, ``ray::RolloutWorker``), less
    their own children: a CPU engine's forked core keeps its actor's title (vLLM's setproctitle does not take in a
    forked Ray worker), and killing the core instead of the actor is another failure than the one asked for."""
    found = {p for p in tagged_processes(tag) if name.encode() in cmdline(p)}
    return sorted(p for p in found if parent(p) not in found)


def left_behind(tag: str, within_s: float = 5.0) -> set[int]:
    """The run's processes still there ``within_s`` after its driver exited (empty: all gone).

    Polls instead of sleeping ``within_s`` and looking once: the same limit, without waiting it
    out when everything is already gone."""
    deadline = time.monotonic() + within_s
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:100]
    except OSError:
        return b"(gone)"


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def reap(tag: str, within_s: float = 30.0) -> list[bytes]:
    """After a kill -9: the command lines of the run's processes still there ``within_s`` later (each then
    killed, so that a failing test still cleans up after itself)."""
    leaked = left_behind(tag, within_s)
    names = [cmdline(p) for p in leaked]
    for p in leaked:
        kill(p)
    return names
