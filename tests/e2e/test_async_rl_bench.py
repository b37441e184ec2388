"""tools/bench/async_rl.py --smoke: the demo workload synchronous and asynchronous (k=1) through real
`rlmega demo` runs, each reported with its median step, final held-out accuracy and what issue 27's check
judges (held-out gain, reward first/last five) and drawn (--plot), so the benchmark cannot rot. (k=2 is
the same code path with another staleness bound, tested in tests/e2e/test_async_rl.py; each mode here is a
~35 s process, so the smoke leaves it out.)"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_reports_sync_and_async_with_ratios_and_accuracy(tmp_path):
    out, plots = tmp_path / "async.json", tmp_path / "plots"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/async_rl.py"),
            "--smoke",
            "--vary-seed",
            "--modes",
            "sync,async_k1",
            "--json",
            str(out),
            "--plot",
            str(plots),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(run["workload"], run["side"]) for run in r["runs"]] == [
        ("demo", "sync"),
        ("demo", "async_k1"),
    ]
    for run in r["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2, 3] and 0 <= run["final_accuracy"] <= 1
        staleness = [s["staleness_mean"] for s in run["steps"]]
        k = {"sync": 0, "async_k1": 1}[run["side"]]
        assert max(staleness) <= k and (k == 0 or max(staleness) > 0), (run["side"], staleness)
    demo = r["summary"]["demo"]
    assert set(demo["median_step_s"]) == {"sync", "async_k1"} and all(
        v > 0 for v in demo["median_step_s"].values()
    )
    assert set(demo["ratio_to_sync"]) == {"async_k1"}
    assert demo["final_accuracy_rounds"] == {
        run["side"]: [run["final_accuracy"]] for run in r["runs"]
    }
    assert "async_k1/sync step time" in proc.stdout and "final held-out accuracy" in proc.stdout
    for run in r["runs"]:  # the check's inputs, from the run's own metrics
        rewards = [s["reward_mean"] for s in run["steps"]]
        # 3 steps: both windows are all
        assert run["reward_first5"] == pytest.approx(sum(rewards) / 3) == run["reward_last5"]
        assert run["evals"][0][0] == 0 and run["gain"] == run["evals"][-1][1] - run["evals"][0][1]
    for mode in ("sync", "async_k1"):  # one picture per layout and mode, from the copied metrics
        assert (plots / f"demo-world1-{mode}.png").stat().st_size > 10_000
        assert (plots / f"demo-world1-{mode}-r0" / "metrics.jsonl").read_text() != ""


def test_check_names_each_missed_bar():
    spec = importlib.util.spec_from_file_location("async_rl", ROOT / "tools/bench/async_rl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    good = {"gain": 0.30, "reward_first5": 0.10, "reward_last5": 0.26, "wall_s": 300.0}
    assert bench.check(good) == []
    assert bench.check({**good, "gain": 0.2}) == ["held-out gain 0.2 < 0.25"]
    assert bench.check({**good, "reward_last5": 0.2}) == ["reward last5 - first5 0.1 < 0.15"]
    assert bench.check({**good, "wall_s": 400.0}) == ["wall 400 s > 360 s"]
    assert (
        len(bench.check({**good, "gain": None, "reward_first5": None, "reward_last5": None})) == 2
    )
