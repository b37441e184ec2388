"""tools/bench/grpo_vs_trl.py: the smoke mode runs rlmega's side end to end (a real `rlmega train`) and
reports every phase, and TRL's side too where its venv exists (CI has none: reported as skipped), so
the issue-12 benchmark cannot rot; a missing TRL venv outside --smoke says how to make one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools/bench/grpo_vs_trl.py"
PHASES = ("generate", "reward", "logprob", "train", "sync")


def _env():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(k, None)
    return env


@pytest.mark.slow
def test_smoke_times_every_phase_of_each_side(tmp_path):
    out = tmp_path / "grpo.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--json", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["workload"]["model"]["hidden_size"] == 128 and r["workload"]["n"] == 8
    (rl,) = [run for run in r["runs"] if run["side"] == "rlmega"]
    assert [s["step"] for s in rl["steps"]] == [1, 2]  # one warm-up step, one measured
    summary = r["summary"]["rlmega"]
    assert summary["steps"] == 1 and summary["step_s"] > 0 and summary["response_length"] > 0
    assert summary["generate"] > 0 and summary["train"] > 0
    assert all(summary[p] >= 0 for p in PHASES)
    # the phases are parts of the step
    assert summary["step_s"] >= summary["generate"] + summary["train"]
    assert "ratio TRL/rlmega" in proc.stdout and "rlmega" in proc.stdout
    if r["trl"]["skipped"]:  # no TRL venv here (CI): said so, no ratio
        assert r["summary"]["trl"] is None and r["summary"]["ratio"] is None
        assert "skipped" in proc.stdout
    else:
        trl = r["summary"]["trl"]
        assert (
            trl["step_s"] > 0
            and trl["generate"] > 0
            and trl["train"] > 0
            and trl["response_length"] > 0
        )
        assert r["summary"]["ratio"] == pytest.approx(trl["step_s"] / summary["step_s"])
        assert ("PASS" in proc.stdout) or ("MISS" in proc.stdout)


def test_missing_trl_python_says_how_to_make_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--trl-python", str(tmp_path / "nope/bin/python")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
    assert "make bench-trl-env" in proc.stderr and "pip install trl==1.16.0" in proc.stderr
