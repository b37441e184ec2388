"""RewardWorker: scores responses with the reward function named in the config (reward.fn).

A plain class that Ray hosts (``reward.num_workers`` of them share each step's samples):

    worker = RewardWorker("rlmega.rewards.arithmetic.score", kwargs={}, timeout_s=30, on_error="zero")
    worker.score([("46</s>", "46"), ("47", "46")])
    # -> {"rewards": [1.0, 0.0], "errors": [None, None]}

A reward function is user code, so one item's failure must not end a run. Items are scored by up
to ``MAX_THREADS`` daemon threads, each item with a deadline of ``timeout_s`` from when its scoring
starts. What goes wrong with an item (it raised, it did not return in time, it returned something
that is not a finite number) is, with ``on_error="zero"``, reward 0 and an error string for that item
(the driver counts them in the step's metrics); with ``on_error="fail"`` the first such item raises
``RewardError`` naming the function, the item and why. A function that hangs cannot be stopped from
Python: its thread is abandoned (a daemon, it dies with the worker) and a fresh thread takes its
place, so later items are not held up.
"""
from __future__ import annotations

import math
import queue
import threading
from time import monotonic

from rlmega.rewards.registry import resolve

MAX_THREADS = 16  # items scored at once by one worker


class RewardError(RuntimeError):
    """A reward function failed on an item with reward.on_error=fail."""


class RewardWorker:
    def __init__(self, fn: str, kwargs: dict | None = None, timeout_s: float = 30.0, on_error: str = "zero"):
        if on_error not in ("zero", "fail"):
            raise ValueError(f"on_error={on_error!r}; use 'zero' or 'fail'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.fn_path, self.fn, self.kwargs = fn, resolve(fn), dict(kwargs or {})
        self.timeout_s, self.on_error = timeout_s, on_error

    def _one(self, response: str, label) -> float:
        value = self.fn(response, label, **self.kwargs)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"returned {value!r}, not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"returned {value}")
        return value

    def score(self, items: list[tuple[str, object]]) -> dict:
        """{"rewards": one float per (response text, label), "errors": None or why, per item}."""
        n = len(items)
        results: list[tuple[float, str | None] | None] = [None] * n
        started: list[float | None] = [None] * n
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            todo.put(i)
        lock, wake = threading.Lock(), threading.Event()

        def work():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                with lock:
                    started[i] = monotonic()
                try:
                    out = (self._one(*items[i]), None)
                except Exception as e:  # the user's function raised: keep its type and message
                    out = (0.0, f"{type(e).__name__}: {e}")
                with lock:
                    if results[i] is None:  # not already given up on as timed out
                        results[i] = out
                wake.set()

        def spawn():
            threading.Thread(target=work, name="reward", daemon=True).start()

        for _ in range(min(MAX_THREADS, n)):
            spawn()
        pending = set(range(n))
        while pending:
            wake.wait(timeout=0.05)
            wake.clear()
            now = monotonic()
            with lock:
                for i in sorted(pending):
                    if results[i] is None and started[i] is not None and now - started[i] > self.timeout_s:
                        results[i] = (0.0, f"no result within reward.timeout_s={self.timeout_s:g}s")
                        spawn()  # the hung thread is lost; keep the pool at full strength
                    if results[i] is not None:
                        pending.discard(i)
                        if results[i][1] is not None and self.on_error == "fail":
                            raise RewardError(
                                f"reward.fn {self.fn_path} failed on item {i} (label {items[i][1]!r}): "
                                f"{results[i][1]}. Fix: correct the function, or set reward.on_error=zero "
                                "to score such items 0 and go on")
        return {"rewards": [r[0] for r in results], "errors": [r[1] for r in results]}
