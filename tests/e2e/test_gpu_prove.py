"""tools/gpu/prove.py, the GPU proof list as one command, rehearsed here so that it cannot rot before a lease.

The smoke (`prove.py --cpu --smoke`) runs step a for real (configs/gpu_one.yaml with the CPU overrides:
`rlmega train`, a checkpoint, then `--resume`) and checks every other step's config; the unit tests below
hold the parts a lease depends on: a run past its budget is stopped with everything it started and the
next run still goes; the summary's numbers come from the runs' metrics.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
import prove  # noqa: E402


def test_the_cpu_smoke_trains_checkpoints_resumes_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/gpu/prove.py"),
            "--cpu",
            "--smoke",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl",
        "summary.json",
        "summary.md",
        "tails.log",
    ]
    summary = json.loads((out / "summary.json").read_text())
    runs = {(r["step"], r["run"]): r for r in summary["runs"]}
    assert [r["status"] for r in summary["runs"]] == ["ok", "ok"] + ["checked"] * 6, summary["runs"]
    train, resume = runs["a", "train"]["result"], runs["a", "resume"]["result"]
    # the resumed run continued the checkpoint
    assert train["steps"] == [1, 2] and resume["steps"] == [3]
    for r in (train, resume):
        # float32: the engine took every sync (1.2e-6 to 1.7e-6 seen)
        assert 0 < r["parity_max"] < 1e-4, r
        assert r["refit_gib"] > 0 and 0 < r["refit_s"] <= r["sync_s"], r
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
    assert "resumed from" in (tmp_path / "work" / "a_resume.log").read_text()
    # the time from rlmega's last line to its exit is kept
    for key in (("a", "train"), ("a", "resume")):
        assert 0 <= runs[key]["shutdown_s"] < runs[key]["seconds"], runs[key]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["run"], m["step"]) for m in lines] == [
        ("a_train", 1),
        ("a_train", 2),
        ("a_resume", 3),
    ]
    table = (out / "summary.md").read_text()
    assert "| a | train | 0 | 1-2 |" in table and "| d | train | checked |" in table
    assert summary["next_step"] is None and "Every step asked for passed" in table
    # each start's own setup.json: the resume's is its own
    for key in (("a", "train"), ("a", "resume")):
        st = runs[key]["startup"]
        assert 0 < st["engines"] < st["ready_s"] < runs[key]["seconds"], st
        assert (
            f"- a/{key[1]}: ready for the first step at {st['ready_s']:.1f} s, engine start"
            in table
        )
    assert "checkpoint load" in runs["a", "resume"]["startup"]
    assert "checkpoint load" not in runs["a", "train"]["startup"]


def test_a_run_past_its_budget_is_stopped_with_what_it_started(tmp_path):
    """SIGTERM at the budget; a run that ignores it is killed GRACE_S later with every process below it, and
    the time since its done line is kept (a run stuck in its shutdown says so)."""
    script = tmp_path / "stubborn.py"
    pidfile = tmp_path / "child.pid"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(0.5)\n"
        f"print({prove.DONE_LINE!r}, flush=True)\n"  # its work done, its exit hangs: 'timed out in shutdown'
        "time.sleep(600)\n"
    )
    old, prove.GRACE_S = prove.GRACE_S, 1.0
    try:
        start = time.monotonic()
        res = prove.run_command([sys.executable, str(script)], tmp_path / "log", budget_s=2.0)
    finally:
        prove.GRACE_S = old
    assert res["timed_out"] and res["rc"] != 0 and time.monotonic() - start < 20
    assert 1.0 < res["shutdown_s"] < 20, res  # from the done line (~0.5 s in) to the kill (~3 s in)
    child = int(pidfile.read_text())
    for _ in range(50):  # (reaped by init: give it a moment)
        if (
            not Path(f"/proc/{child}").exists()
            or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        ):
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail(
            "the run's child (in a session of its own, as Ray's processes are) outlived the kill"
        )
    assert "started" in (tmp_path / "log").read_text()


def test_a_failed_run_is_recorded_with_its_tail_and_the_next_one_goes(tmp_path, monkeypatch):
    """Step a fails (its command exits 3), step e still runs; the summary says where the next lease starts."""

    def fake_runs(key, work, models, cpu, smoke, attention):
        code = "print('boom'); raise SystemExit(3)" if key == "a" else "print('fine')"
        return [prove.Run("only", [sys.executable, "-c", code])]

    monkeypatch.setattr(prove, "step_runs", fake_runs)
    monkeypatch.setattr(prove, "make_models", lambda *a, **k: {})
    rc = prove.main(
        ["--cpu", "--steps", "a,e", "--work", str(tmp_path), "--out", str(tmp_path / "out")]
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert rc == 1 and [r["status"] for r in summary["runs"]] == ["failed (exit 3)", "ok"]
    assert (
        "boom" in summary["runs"][0]["tail"]
        and "boom" in (tmp_path / "out" / "tails.log").read_text()
    )
    assert (
        summary["next_step"] == "a" and "--from a" in (tmp_path / "out" / "summary.md").read_text()
    )


def test_deadline_leaves_steps_unstarted_for_the_next_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(
        prove, "step_runs", lambda key, *a: [prove.Run("only", [sys.executable, "-c", "pass"])]
    )
    monkeypatch.setattr(prove, "make_models", lambda *a, **k: {})
    rc = prove.main(["--cpu", "--from", "c", "--deadline-s", "100", "--work", str(tmp_path)])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps_asked"] == ["c", "d", "e"]
    # 100 - 45 < 60 s
    assert rc == 1 and {r["status"] for r in summary["runs"]} == {"not started: out of time"}
    assert summary["next_step"] == "c"


def test_the_summary_takes_medians_after_the_first_step_and_the_worst_parity():
    ms = [
        {
            "step": i,
            "time_step": t,
            "time_generate": 1.0,
            "time_logprob": 0.5,
            "time_train": 2.0,
            "time_sync": 0.4,
            "time_weight_transfer": 0.3,
            "sync_bytes": 2 * prove.GiB,
            "tokens_per_s": tps,
            "response_length": 100.0,
            "reward_mean": r,
            "parity_max": p,
            "logprob_diff_mean": 0.01,
        }
        for i, t, tps, r, p in (
            (1, 90.0, 10.0, 0.1, 0.02),
            (2, 5.0, 1000.0, 0.2, 0.05),
            (3, 7.0, 800.0, 0.3, 0.03),
        )
    ]
    s = prove.summarise_train(ms, gpus=1)
    # warm-up step left out
    assert s["steps"] == [1, 2, 3] and s["first_step_s"] == 90.0 and s["step_s"] == 6.0
    assert s["tokens_per_s_per_gpu"] == 900.0 and s["refit_gib"] == 2.0 and s["refit_s"] == 0.3
    assert s["parity_max"] == 0.05 and s["reward_first"] == 0.1 and s["reward_last"] == 0.3
