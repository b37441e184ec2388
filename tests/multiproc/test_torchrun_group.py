"""TorchrunGroup (launch/torchrun_group.py) under a real torchrun: calls reach every rank and come back
in rank order, and a rank that raises is reported by name at once while rank 0's own share hangs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_calls_reach_every_rank_and_a_failing_rank_is_named_at_once():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "-m",
            "rlmega.testing.torchrun_probe",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calls"] == [["t", 0, 70], ["t", 1, 70], ["t", 2, 70]]
    assert result["rank0"] == ["t", 0, 80] and result["rank0_raw"] == [["t", 0, 90], None, None]
    assert result["counts"] == [3, 3, 3]
    assert result["error"] == "trainer rank 2 raised ValueError: rank 2 fails on purpose"
    assert (
        result["worker"] == "trainer rank 2"
        and result["cause"] == "ValueError"
        and result["traceback"]
    )
    # rank 0's share sleeps 600 s: the failure is seen by watching the store, not by waiting for it
    assert result["seconds_to_report"] < 10, result
