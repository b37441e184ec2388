"""One node's Ray for a batch job, kept inside the job: ``python -m rlmega.launch.ray_node ray start ... --block``.

tools/slurm/rlmega.sbatch runs this on every node (an srun step) in place of a bare ``ray start --block``.
It makes itself the child subreaper of what it starts (PR_SET_CHILD_SUBREAPER), runs the command as its child,
and returns only once every process under it has ended:

- Slurm finds a job's processes by their parents (proctrack/linuxproc, proctrack/pgid). A Ray worker is the
  raylet's child; when the raylet ends before it (a cancelled job's SIGTERM reaches every process at once),
  the worker would be re-parented to init, out of the job's sight, and Slurm would call the job gone while
  trainer ranks still held their memory (test_slurm's scancel check saw two ``ray::_RankHost`` processes
  alive then, in CI under load). Here they are re-parented to this process instead, still the job's.
- SIGTERM and SIGINT are passed to the command (``ray start --block`` stops the node's Ray processes); once it
  has exited, what is still running under this process gets ``grace_s`` seconds, then SIGTERM, then after
  ``grace_s`` more SIGKILL. Slurm's own KillWait SIGKILL ends this process too, and every process still under
  it, since they remain the job's.
- SIGUSR1 is ignored, here and (inherited through exec) in the command: ``scancel --signal=USR1`` without
  ``--batch`` signals the steps, and USR1's default action would end Ray under a running trainer.

Exit status: the command's (128 + N when a signal N ended it). Linux only (prctl); elsewhere the command
runs as a plain child, without the subreaper, and a warning says so.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it, not to init. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def reap() -> None:
    """Collect every ended child (the command's orphans become ours to wait for)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def drain(grace_s: float, poll_s: float = 0.1) -> list[int]:
    """Wait until no process is left under this one: ``grace_s`` seconds, then SIGTERM to those left and
    ``grace_s`` more, then SIGKILL. Returns the pids that had to be signalled."""
    signalled: list[int] = []
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for pid in children(os.getpid()):
                try:
                    os.kill(pid, sig)
                    signalled.append(pid)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + (grace_s if sig != signal.SIGKILL else 5.0)
        while True:
            reap()
            if not children(os.getpid()):
                return sorted(set(signalled))
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
    return sorted(set(signalled))


def run(cmd: list[str], grace_s: float = 5.0) -> int:
    if not become_subreaper():
        print(
            "rlmega.launch.ray_node: no PR_SET_CHILD_SUBREAPER here: processes Ray leaves behind may outlive "
            "this step",
            file=sys.stderr,
            flush=True,
        )
    # before the child starts: it inherits the disposition
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.Popen(cmd)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = child.wait()
    left = drain(grace_s)
    if left:
        print(
            f"rlmega.launch.ray_node: {len(left)} process(es) still running {grace_s:g}s after the command "
            f"ended were signalled: {left}",
            file=sys.stderr,
            flush=True,
        )
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m rlmega.launch.ray_node COMMAND [ARG ...]", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
