"""Worker failures, told whole: which worker, what it raised, and its traceback.

Ray wraps an exception raised inside an actor method in ``RayTaskError``, whose text is a long
remote traceback with the original message somewhere in it, and a dead actor in ``RayActorError``.
The driver turns both into one line naming the worker and the original exception's type and
message; the remote traceback stays on the error for the cases where it helps (unexpected errors).
"""

from __future__ import annotations

import re

import ray


# Ray's words for an actor whose __init__ raised (ActorDiedError); the traceback follows them.
_CREATION = "The actor died because of an error raised in its creation task"


class WorkerFailed(RuntimeError):
    """A worker raised or died. ``worker`` names it, ``cause`` is the original exception (None when it
    died), ``remote_traceback`` is the worker's traceback text ("" when it died)."""

    def __init__(
        self,
        message: str,
        worker: str,
        cause: BaseException | None = None,
        remote_traceback: str = "",
    ):
        super().__init__(message)
        self.worker, self.cause, self.remote_traceback = worker, cause, remote_traceback


def describe(error: BaseException, worker: str) -> WorkerFailed:
    """A RayTaskError / RayActorError from ``worker`` ("trainer rank 2", "rollout engine 0") as WorkerFailed."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, WorkerFailed):  # raised by a worker that relayed another's failure
            return cause
        what = (
            f"{type(cause).__name__}: {cause}" if cause is not None else str(error).splitlines()[0]
        )
        return WorkerFailed(
            f"{worker} raised {what}",
            worker,
            cause,
            getattr(error, "traceback_str", "") or str(error),
        )
    if isinstance(error, ray.exceptions.RayActorError):
        text = str(error)
        # its __init__ raised: the traceback's last line is what it raised, by its own words
        if _CREATION in text:
            last = [line.strip() for line in text.splitlines() if line.strip()][-1]
            # "pkg.mod.KeyError: x" -> "KeyError: x"
            last = re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+: )", "", last)
            return WorkerFailed(
                f"{worker} died while starting: {last}", worker, remote_traceback=text
            )
        first = text.splitlines()[0] if text else type(error).__name__
        return WorkerFailed(f"{worker} died: {first}", worker)
    return WorkerFailed(f"{worker}: {type(error).__name__}: {error}", worker, error)


def first_failure(refs: list, names: list[str], timeout: float | None) -> list:
    """ray.get(refs), but the first failing ref raises WorkerFailed naming its worker (names[i]).

    Waits for any ref at a time, so a worker that failed is reported at once even while its peers
    are blocked (e.g. in a collective waiting for it). GetTimeoutError when nothing is ready in time.
    """
    return meet({"": (refs, names)}, timeout)[""]


def meet(
    groups: dict[str, tuple[list, list[str]]], timeout: float | None, done=None
) -> dict[str, list]:
    """Wait for workers that start at once: ``groups`` {phase: (refs, names[i] for refs[i])}; returns
    {phase: its results}. ``done(phase)`` is called as each phase's last ref is ready. The first ref to fail,
    in any group, raises WorkerFailed naming its worker, while the others are still at work: an engine
    that dies while the trainer loads is reported then, not after. GetTimeoutError when nothing is ready
    in time."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    owner = {
        ref: (phase, names[i])
        for phase, (refs, names) in groups.items()
        for i, ref in enumerate(refs)
    }
    left = {phase: len(refs) for phase, (refs, _) in groups.items()}
    for phase in [p for p, n in left.items() if n == 0]:
        if done is not None:
            done(phase)
    pending = list(owner)
    while pending:
        wait = None if deadline is None else max(deadline - time.monotonic(), 0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if not ready:
            raise ray.exceptions.GetTimeoutError("timed out")
        phase, name = owner[ready[0]]
        try:
            ray.get(ready[0])
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            raise describe(e, name) from e
        left[phase] -= 1
        if left[phase] == 0 and done is not None:
            done(phase)
    return {phase: ray.get(refs) for phase, (refs, _) in groups.items()}
