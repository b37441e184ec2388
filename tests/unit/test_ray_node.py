"""rlmega.launch.ray_node, the wrapper tools/slurm/rlmega.sbatch runs `ray start --block` under on every node:
processes orphaned under it stay its own (so Slurm's proctrack/linuxproc still counts them as the job's) and
it ends only after they have; TERM reaches the command; USR1 is ignored. tests/e2e/test_slurm.py runs it in a
real job. Each command below is a Python one-liner that leaves a grandchild behind (a double fork), as a Ray
worker is left when its raylet ends first."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's"
)

# Forks a grandchild that writes its pid and parent's pid to FILE, sleeps S seconds (ignoring TERM when
# IGN), then exits; the command itself exits at once.
ORPHAN = """
import os, signal, sys, time
path, seconds, ignore = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "IGN"
if os.fork() == 0:
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)  # as a Ray worker writes to its log files, not the step's pipes
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if ignore:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(0.3)  # the middle process has exited by then: this one is an orphan
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        time.sleep(seconds)
    os._exit(0)
os.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _orphan(tmp_path: Path, wrap: bool, seconds: float, ignore_term: bool = False):
    info = tmp_path / "orphan"
    cmd = [sys.executable, "-c", ORPHAN, str(info), str(seconds), "IGN" if ignore_term else "-"]
    if wrap:
        cmd = [sys.executable, "-m", "rlmega.launch.ray_node", *cmd]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    deadline = time.monotonic() + 10
    while not info.exists() or not info.read_text():
        assert time.monotonic() < deadline, proc.stderr
        time.sleep(0.05)
    pid, parent = map(int, info.read_text().split())
    return proc, took, pid, parent


def test_without_it_the_orphan_outlives_the_command(tmp_path):
    proc, took, pid, _ = _orphan(tmp_path, wrap=False, seconds=3)
    try:
        assert proc.returncode == 0 and took < 3
        assert _alive(pid)  # what Slurm's linuxproc would no longer see as the job's
    finally:
        os.kill(pid, signal.SIGKILL)


def test_the_orphan_stays_its_own_and_it_waits_for_it(tmp_path):
    proc, took, pid, parent = _orphan(tmp_path, wrap=True, seconds=1.5)
    assert proc.returncode == 0, proc.stderr
    assert not _alive(pid) and took >= 1.5  # it returned once the orphan had ended, by itself
    assert "signalled" not in proc.stderr
    # the orphan's parent was the wrapper (the command's pid is gone; the wrapper's is the only one left)
    assert parent != 1 and not _alive(parent)


def test_an_orphan_that_ignores_term_is_killed_after_the_grace(tmp_path):
    proc, took, pid, _ = _orphan(tmp_path, wrap=True, seconds=600, ignore_term=True)
    assert proc.returncode == 0, proc.stderr
    assert not _alive(pid) and took < 30  # grace 5 s, TERM (ignored), 5 s, KILL
    assert f"[{pid}]" in proc.stderr and "signalled" in proc.stderr


def test_term_reaches_the_command_and_usr1_does_not_end_it(tmp_path):
    marker = tmp_path / "term"
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('TERM'), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmega.launch.ray_node", sys.executable, "-c", code, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)  # ignored by the wrapper and, inherited, by the command
    time.sleep(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 7 and marker.read_text() == "TERM"
