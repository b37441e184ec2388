"""Start-up, end to end: the trainer ranks and the engine start at once (rlmega/launch/roles.py), and a run
prints and records its phases (rlmega/rundir/startup.py).

Starting things at once must not turn a failure into a hang or a leak: a worker killed while the other role
is still starting (the kernel's OOM killer does this) is reported by name within seconds, and every process
of the run goes. The bench's smoke (tools/bench/startup.py --smoke) is the check that phases are printed and
recorded in RUN_DIR/setup.json, and that its engine-start count runs.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train import ROOT, _cmd, _left_behind, _tagged_processes, model  # noqa: F401,F811

NO_WARM_START = "trainer.warmup_sft_steps=0"
# The phases every run of tools/bench/startup.py's cases goes through, in the order they end or may end.
PHASES = [
    "imports",
    "config checks",
    "tokenizer and prompts",
    "Ray",
    "placement",
    "trainer (policy)",
    "engines",
    "first weight sync",
]


def test_startup_bench_smoke_prints_and_records_every_phase(tmp_path):
    out = tmp_path / "startup.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/startup.py"), "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    c = r["cases"]["world1"]["new"]
    run = c["runs"][0]
    phases = [p["phase"] for p in run["setup"]["phases"]]
    assert sorted(phases) == sorted(PHASES), phases
    rows = {p["phase"]: p for p in run["setup"]["phases"]}
    for p in rows.values():
        assert (
            0 <= p["start_s"] <= p["end_s"]
            and abs(p["seconds"] - (p["end_s"] - p["start_s"])) < 2e-3
        )
    # trainer and engines start together, once placement is done; the sync waits for both
    assert (
        rows["trainer (policy)"]["start_s"]
        == rows["engines"]["start_s"]
        == rows["placement"]["end_s"]
    )
    assert rows["first weight sync"]["start_s"] == max(
        rows["trainer (policy)"]["end_s"], rows["engines"]["end_s"]
    )
    assert (
        run["setup"]["ready_s"]
        == rows["first weight sync"]["end_s"]
        <= run["first_step_s"]
        <= run["run_s"]
    )
    assert r["floor_s"] > 0 and "floor (import torch, vllm, megatron.core, ray)" in proc.stdout
    assert "world1 phases (median s, from -> to): imports" in proc.stdout
    starts = r["engine_starts"]  # one engine in a fresh Ray actor, as rlmega train starts it
    assert starts["starts"] == 1 and starts["failures"] == [] and len(starts["seconds"]) == 1, (
        starts
    )
    assert "engine starts in fresh Ray actors: 1, failed 0" in proc.stdout


@pytest.mark.parametrize(
    "victim, other_phase, named",
    [
        ("RolloutWorker", "trainer (policy", r"rollout engine 0 died"),
        ("_RankHost", "engines ", r"trainer rank \d died"),
    ],
    ids=["engine_while_trainer_loads", "rank_while_engine_starts"],
)
def test_a_worker_killed_while_the_other_role_starts_is_named_at_once_and_nothing_is_left(
    model, tmp_path, victim, other_phase, named
):
    tag = f"startup-{victim}-{os.getpid()}"
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(model, run, 2, NO_WARM_START),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "RLMEGA_TEST_TAG": tag},
    )
    deadline = time.monotonic() + 300
    victims = []
    # the victim's process, as soon as Ray started it: the other role is still starting
    while not victims:
        assert proc.poll() is None and time.monotonic() < deadline, f"no {victim} process appeared"
        victims = [p for p in _tagged_processes(tag) if victim.encode() in _cmdline(p)]
        time.sleep(0.05)
    os.kill(victims[0], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the driver hung for 60 s after a {victim} died during start-up")
    took = time.monotonic() - killed_at
    assert proc.returncode == 1, err[-3000:]
    assert re.search(named, err), err[-3000:]
    # the other role had not finished starting: the failure was reported without waiting for it
    assert "start-up" in out and not re.search(
        rf"start-up +[\d.]+ s  {re.escape(other_phase)}", out
    ), out[-3000:]
    # Measured from the kill to the driver's exit (2026-12-02, the machine loaded to 9-10 runnable): 5.4-5.7 s,
    # most of it Ray's shutdown; with the driver waiting for the trainer before it looked at the engine, 33 s.
    assert took < 15, f"{took:.0f} s from the kill to the driver's exit"
    leaked = _left_behind(tag)
    assert not leaked, f"processes left behind: {[_cmdline(p) for p in leaked]}"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:200]
    except OSError:
        return b"(gone)"
