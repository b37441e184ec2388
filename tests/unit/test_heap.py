"""rlmega/process/heap.py: a process's start-up imports run without the collector, and what they built is frozen after
(later collections skip it); the collector comes back as it was."""

import gc
import subprocess
import sys

from rlmega.process.heap import imports_uncollected


def test_the_block_runs_uncollected_then_freezes_what_it_built():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with imports_uncollected():
            assert not gc.isenabled()
            made = [[i] for i in range(10_000)]  # tracked objects, as a module's import makes
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()  # this test process collects as before
    gc.disable()
    try:
        with imports_uncollected(freeze=False):
            pass
        # off before, off after; nothing frozen
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_python_m_rlmega_train_imports_uncollected_then_freezes(tmp_path):
    """`python -m rlmega.train` (torchrun's ranks) turns the collector off before its module's imports and
    settles after them: a usage error, which main() reports after the imports, finds the heap frozen."""
    # runs before rlmega.train: records the collector's state at exit
    probe = tmp_path / "sitecustomize.py"
    probe.write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: sys.stderr.write(\n"
        "    f'PROBE {gc.isenabled()} {gc.get_freeze_count()}\\n'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "rlmega.train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    probe_line = [line for line in out.stderr.splitlines() if line.startswith("PROBE")]
    assert probe_line, out.stderr[-2000:]
    _, enabled, frozen = probe_line[-1].split()
    # torch, transformers, Ray, ...
    assert enabled == "True" and int(frozen) > 100_000, out.stderr[-2000:]
