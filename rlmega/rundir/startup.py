"""The start-up of one `rlmega train`, phase by phase, in seconds since the command started.

    clock = StartupClock()                       # t = 0 is this process's start (the interpreter's)
    clock.done("imports")                        # a phase that began where the previous one ended
    began = clock.now(); ...; clock.done("engines", began)   # one that overlapped others
    clock.write(run_dir)                         # RUN_DIR/setup.json, replaced durably

Each phase is printed as it ends ("rlmega: start-up   9.8 s  engines 6.1 s (from 3.7 s)"), written to
RUN_DIR/setup.json (each start of a run writes its own: a resume has a start-up too) and shown on the
dashboard. Phases can overlap: the trainer ranks, the critic and the engines start at once
(rlmega/launch/roles.py), so the sum of the phases' seconds is more than the time to the first step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlmega.rundir.durable import replace_durably

SETUP_FILE = "setup.json"


def process_start_monotonic() -> float:
    """time.monotonic() at this process's start, read from /proc (Linux); now, where it cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # field 22: starttime, in clock ticks
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        # CLOCK_MONOTONIC and /proc/uptime both count from boot (suspend aside): the age carries over
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


class StartupClock:
    def __init__(self, t0: float | None = None, echo: bool = True):
        """``t0``: time.monotonic() of t = 0 (default: this process's start); ``echo``: print each phase."""
        self.t0 = process_start_monotonic() if t0 is None else t0
        self.echo = echo
        # {"phase", "start_s", "end_s", "seconds"} in the order they ended
        self.phases: list[dict] = []
        self._last_end = 0.0
        self.listeners: list = []  # called with the phase list after each phase (the dashboard)

    def now(self) -> float:
        """Seconds since t = 0."""
        return time.monotonic() - self.t0

    def done(self, phase: str, began: float | None = None) -> dict:
        """Record ``phase`` as ending now; it began at ``began`` (seconds since t = 0), by default where
        the phase that ended last did."""
        end = self.now()
        start = self._last_end if began is None else began
        row = {
            "phase": phase,
            "start_s": round(start, 3),
            "end_s": round(end, 3),
            "seconds": round(end - start, 3),
        }
        self.phases.append(row)
        self._last_end = max(self._last_end, end)
        if self.echo:
            overlap = f" (from {start:.1f} s)" if began is not None else ""
            print(
                f"rlmega: start-up {end:6.1f} s  {phase} {end - start:.1f} s{overlap}", flush=True
            )
        for listener in self.listeners:
            listener(list(self.phases))
        return row

    def summary(self) -> dict:
        """What setup.json holds: every phase, and ``ready_s``: when the last one ended."""
        return {"ready_s": round(self._last_end, 3), "phases": list(self.phases)}

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / SETUP_FILE
        replace_durably(path, json.dumps(self.summary(), indent=1) + "\n")
        return path


def read_setup(run_dir: str | Path) -> dict:
    """RUN_DIR/setup.json as written by StartupClock.write ({} where the run never got that far)."""
    path = Path(run_dir) / SETUP_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())
