"""An engine death told by its cause: the engine core's own error line, and the log that holds it.

When vLLM's engine core process fails, the caller only gets ``EngineDeadError: EngineCore encountered
an issue. See stack trace (above) for the root cause.``; the stack trace went to the engine core's
stderr, which is the RolloutWorker's (under Ray: the actor's worker log file). A user reading the
driver's error should not have to find that file: ``EngineDied`` carries the root-cause line (the last
exception the engine core logged, with the frame that raised it) and the log's path.
"""

from __future__ import annotations

import os
import re

_TAIL_BYTES = 4 << 20  # the end of the log: the death is the last thing the engine core wrote
# "(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512] RuntimeError: CPU Generator does not use offset"
_LOGGED = re.compile(
    r"^\((?:EngineCore|Worker)[^)]*\)\s+ERROR\s+\S+\s+\S+\s+\[[^\]]*\]\s?(?P<text>.*)$"
)
_EXCEPTION = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s*(?P<msg>.*))?$"
)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


class EngineDied(RuntimeError):
    """The engine core process died; the message names its root cause and where its log is."""


class EngineStartFailed(RuntimeError):
    """The engine did not start; the message names the root cause (the engine core's own error where it logged
    one, else what vLLM raised) and where its log is."""


_DIED = re.compile(r"the vLLM engine core died: [^\n\\]*")


def engine_death_in(text: str) -> str | None:
    """An ``EngineDied`` message inside another error's text (a failed request's repr, a Ray traceback)."""
    m = _DIED.search(text)
    return m.group(0) if m else None


def engine_root_cause(log_text: str) -> str | None:
    """The last exception an engine core logged, as ``"Type: message (in fn, file:line)"``; None if none.

    Reads vLLM's log format (each engine-core line prefixed ``(EngineCore pid=N) ERROR ... [file:line]``).
    ``EngineDeadError`` is the caller's echo of the death, not its cause, and is skipped.
    """
    cause, frame = None, None
    last_frame = None
    for raw in log_text.splitlines():
        m = _LOGGED.match(raw)
        if not m:
            continue
        text = m.group("text")
        f = _FRAME.match(text)
        if f:
            last_frame = f
            continue
        e = _EXCEPTION.match(text.strip())
        if e and not e.group("type").endswith("EngineDeadError"):
            cause, frame = text.strip(), last_frame
    if cause is None:
        return None
    if frame is not None:
        where = frame.group("file").split("site-packages/")[-1]
        cause += f" (in {frame.group('fn')}, {where}:{frame.group('line')})"
    return cause


def own_log_paths() -> list[str]:
    """The files this process's stdout and stderr go to (a Ray worker's .out and .err logs: vLLM logs to
    stdout), without terminals and pipes."""
    paths = []
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.isfile(path) and path not in paths:
            paths.append(path)
    return paths


def _cause_in(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            return engine_root_cause(f.read().decode("utf-8", "replace"))
    except OSError:
        return None


def engine_died(error: BaseException, log_paths: list[str] | None = None) -> EngineDied:
    """``EngineDied`` for an ``EngineDeadError``: its root cause, read from the end of the engine's logs
    (default: where this process's stdout and stderr go, which the engine core inherits)."""
    paths = own_log_paths() if log_paths is None else log_paths
    for path in paths:
        cause = _cause_in(path)
        if cause:
            return EngineDied(f"the vLLM engine core died: {cause} (engine log: {path})")
    where = (
        f"engine logs: {', '.join(paths)}"
        if paths
        else f"engine log: the stdout/stderr of process {os.getpid()}"
    )
    return EngineDied(f"the vLLM engine core died: {error} (root cause not found; {where})")


def engine_start_failed(
    error: BaseException, log_paths: list[str] | None = None
) -> EngineStartFailed:
    """``EngineStartFailed`` for what AsyncLLM raised while starting: vLLM's own message is often "Engine core
    initialization failed. See root cause above", the cause being in the engine core's log (default: this
    process's stdout and stderr, which the core inherits), so that log's last exception is named first."""
    paths = own_log_paths() if log_paths is None else log_paths
    raised = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    for path in paths:
        cause = _cause_in(path)
        if cause:
            return EngineStartFailed(f"the vLLM engine did not start: {cause} (engine log: {path})")
    where = (
        f"engine log: {', '.join(paths)}"
        if paths
        else f"engine log: the stdout/stderr of process {os.getpid()}"
    )
    return EngineStartFailed(f"the vLLM engine did not start: {raised} ({where})")
