"""Stopping a run cleanly: signals and ``rlmega stop RUN_DIR``.

    stop = StopRequest(run_dir)
    with Roles(cfg) as roles, stop:  # handlers installed after Ray's start-up (it installs its own)
        ...  if stop.requested(): finish this step, checkpoint, release the workers, exit EXIT_STOPPED

SIGTERM (``kill``, a container stop, ``scancel`` of the batch shell), SIGINT (Ctrl-C) and SIGUSR1
(what Slurm sends before the time limit with ``#SBATCH --signal=B:USR1@120``) all ask the driver to
stop after the current step; a second one stops at once (KeyboardInterrupt: the workers are still
released). ``rlmega stop RUN_DIR`` asks the same from any shell that sees the run folder, by writing
``RUN_DIR/STOP``; the driver removes that file when it starts and when it acts on it.

The handler only sets a flag: a signal can arrive while the main thread holds a lock, so it takes
none. The driver loop reads the flag between steps.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_FILE = "STOP"


def request_stop(run_dir: str | Path, reason: str = "rlmega stop") -> Path:
    """Ask the run writing to ``run_dir`` to stop after its current step (write, then rename)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run folder (no config.yaml): give the trainer.run_dir of a run"
        )
    tmp = run_dir / f".{STOP_FILE}.{os.getpid()}"
    tmp.write_text(reason + "\n")
    os.replace(tmp, run_dir / STOP_FILE)
    return run_dir / STOP_FILE


class StopRequest:
    def __init__(self, run_dir: str | Path):
        self.file = Path(run_dir) / STOP_FILE
        self.reason: str | None = None
        self._previous: dict = {}
        self.file.unlink(missing_ok=True)  # a stop asked of an earlier run is not for this one

    def __enter__(self) -> "StopRequest":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:  # asked twice: stop now
            self.uninstall()
            raise KeyboardInterrupt(f"second stop request ({signal.Signals(signum).name})")
        self.reason = signal.Signals(signum).name

    def requested(self) -> bool:
        if self.reason is None and self.file.exists():
            self.reason = f"{self.file}: {self.file.read_text().strip() or 'stop'}"
            self.file.unlink(missing_ok=True)
        return self.reason is not None
