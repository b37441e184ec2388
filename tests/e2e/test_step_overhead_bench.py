"""tools/bench/step_overhead.py --smoke: a real `rlmega train` of 3 tiny steps, and the share of each step
spent outside generate, reward, log-probs, train and sync, computed from its metrics.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_overhead_smoke_reports_the_share_outside_the_phases(tmp_path):
    out = tmp_path / "oh.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/step_overhead.py"), "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [s["step"] for s in r["steps"]] == [1, 2, 3]
    for s in r["steps"]:
        assert 0 < s["work_s"] <= s["time_step"]  # the phases happen inside the step
        assert abs(s["overhead_s"] - (s["time_step"] - s["work_s"])) < 1e-9 and 0 <= s["share"] < 1
    measured = sorted(s["share"] for s in r["steps"][1:])
    assert r["median_share"] == (measured[0] + measured[1]) / 2  # the median of steps 2 and 3
    assert r["verdict"] == ("PASS" if r["median_share"] <= 0.05 else "MISS")
    assert f"(target <= 5%: {r['verdict']})" in proc.stdout
