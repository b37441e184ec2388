"""How an rlmega command leaves its process: everything Python's own exit does that a user can see, then
``os._exit``, without the interpreter's teardown.

Why: after "done", a world-1 ``rlmega train`` spent 1.5-1.6 s tearing down the interpreter (the last
garbage collections over torch, vLLM, Megatron and Ray's modules), time the user waits for nothing; without
it, 0.06-0.09 s (2 interleaved pairs, 2026-12-04). ``gc.freeze`` at exit cut the collections but made
triton's nanobind bindings print their "leaked instances" report (~100 lines) into every run's stderr: that
report comes from the teardown this skips.

What still runs, in Python's own order: non-daemon threads are joined (``threading._shutdown``, which the
interpreter calls first), then every ``atexit`` handler (ray.shutdown, logging's flush, multiprocessing's
children, torch's), then stdout and stderr are flushed. Only the entry points call :func:`leave`: a process
that imports rlmega as a library exits as Python does.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def leave(code: int | None) -> None:
    """Exit this process with ``code`` (None = 0) once its threads, atexit handlers and streams are done."""
    code = 0 if code is None else int(code)
    threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001 - the interpreter's own first step at exit
    atexit._run_exitfuncs()  # noqa: SLF001 - atexit's handlers, as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to keep
            pass
    os._exit(code)
