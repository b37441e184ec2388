"""tools/bench/async_rl.py --smoke: the demo workload in every mode (sync, async k=1, async k=2) through real
`rlmega demo` runs, each reported with its median step and final held-out accuracy, so the benchmark
cannot rot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_reports_every_mode_with_ratios_and_accuracy(tmp_path):
    out = tmp_path / "async.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench/async_rl.py"), "--smoke", "--vary-seed", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(run["workload"], run["side"]) for run in r["runs"]] == [("demo", "sync"), ("demo", "async_k1"),
                                                                     ("demo", "async_k2")]
    for run in r["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2, 3] and 0 <= run["final_accuracy"] <= 1
        staleness = [s["staleness_mean"] for s in run["steps"]]
        k = {"sync": 0, "async_k1": 1, "async_k2": 2}[run["side"]]
        assert max(staleness) <= k and (k == 0 or max(staleness) > 0), (run["side"], staleness)
    demo = r["summary"]["demo"]
    assert set(demo["median_step_s"]) == {"sync", "async_k1", "async_k2"} and all(v > 0 for v in demo["median_step_s"].values())
    assert set(demo["ratio_to_sync"]) == {"async_k1", "async_k2"}
    assert demo["final_accuracy_rounds"] == {run["side"]: [run["final_accuracy"]] for run in r["runs"]}
    assert "async_k1/sync step time" in proc.stdout and "final held-out accuracy" in proc.stdout
