"""ActorManager: the run's coordinator (stop flag, queues, token/timing/staleness stats, dashboard).

A plain, thread-safe class. ``rlmega/launch/`` hosts it as a Ray actor; tests and single-process
runs use it in-process. Every worker reports into it; the dashboard (``rlmega.dashboard``) only
reads ``status()``.

    manager = ActorManager()                       # dashboard on 127.0.0.1, a free port
    print(f"dashboard: http://127.0.0.1:{manager.get_dashboard_port()}/")
    manager.register_queue("rollouts", rollout_queue.qsize)   # size over time, polled every second
                                                             # (besides its own two: prompts, results)
    manager.report_token_statistics(prefill_tokens=4096, decode_tokens=16384, seconds=3.2)
    manager.report_batch_generation_time(step, 3.2)
    manager.report_training_step_time(step, 5.1)
    manager.report_metrics(step, {"reward_mean": 0.41, "kl_ref": 0.003})
    manager.report_progress(step, total_steps)
    # Asynchronous mode: trajectories trained at `step` by staleness (trainer version - the oldest
    # weight version that sampled them), and how busy engines and trainer were during the step.
    manager.report_staleness(step, {0: 48, 1: 14, 2: 2})
    manager.report_busy(step, engine_fraction=0.93, trainer_fraction=0.71)
    if manager.should_stop(): ...
    manager.cleanup()                              # stops the server and the polling thread

Views: ``GET /`` (page), ``GET /api/status`` (JSON), ``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import logging
import math
import numbers
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from rlmega.agents.buffer import PromptQueue, ResultQueue

logger = logging.getLogger(__name__)

QUEUE_HISTORY_LEN = 120  # samples per queue: 2 minutes at the default 1 s poll
BUSY_HISTORY_LEN = 500  # steps of busy fractions kept for the chart


class ActorManager:
    def __init__(
        self,
        dashboard: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        poll_interval_s: float = 1.0,
        token_window_s: float = 60.0,
    ):
        if token_window_s <= 0 or poll_interval_s <= 0:
            raise ValueError("token_window_s and poll_interval_s must be > 0")
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._window_s = float(token_window_s)
        self._poll_interval_s = float(poll_interval_s)
        self._should_stop = False
        # Token reports as intervals (start, end, prefill, decode); pruned once they leave the window.
        self._token_events: deque[tuple[float, float, int, int]] = deque()
        self._earliest_start = self._t0  # the rate's denominator never reaches back past this
        self._totals = {"prefill": 0, "decode": 0}
        self._timings: dict[str, dict[str, Any]] = {}
        self._kv_concurrency: dict[int, float] = {}
        self._startup: list[dict] = []  # the run's start-up phases (rlmega/rundir/startup.py)
        self._metrics_history: list[dict[str, float]] = []
        self._progress: list[tuple[float, int]] = []  # (time, step): first and latest report
        self._total_steps: int | None = None
        self._queue_fns: dict[str, Callable[[], int]] = {}
        self._queues: dict[str, dict[str, Any]] = {}
        self._staleness_total: dict[int, int] = {}  # staleness -> trajectories, over the run
        self._staleness_last: dict[int, int] = {}
        self._staleness_last_step: int | None = None
        self._busy: deque[tuple[int, float, float]] = deque(maxlen=BUSY_HISTORY_LEN)

        self._stop_event = threading.Event()
        self._poller = threading.Thread(
            target=self._poll_loop, name="rlmega-queue-poll", daemon=True
        )
        self._poller.start()
        # The run's own queues (rlmega/agents/buffer.py): the producer fills them, the trainer drains
        # "results"; hosted here so that the dashboard charts them like any registered queue.
        self.prompts, self.results = PromptQueue(), ResultQueue()
        self.register_queue("prompts", self.prompts.size)
        self.register_queue("results", self.results.size)
        self._server: Any = None  # uvicorn's Server, once the dashboard runs
        self._server_thread: threading.Thread | None = None
        self._port: int | None = None
        if dashboard:
            try:
                self._start_dashboard(host, port)
            except BaseException:
                self.cleanup()  # a failed start must not leave the poller running
                raise

    # ---- stop flag -------------------------------------------------------------------------------
    def set_should_stop(self, value: bool = True) -> None:
        with self._lock:
            self._should_stop = bool(value)

    def should_stop(self) -> bool:
        with self._lock:
            return self._should_stop

    # ---- tokens ----------------------------------------------------------------------------------
    def report_token_statistics(
        self, prefill_tokens: int, decode_tokens: int, seconds: float | None = None
    ) -> None:
        """Tokens processed, ending now; ``seconds`` (if known) is how long they took, so a long
        generation is spread over its real interval instead of landing as one spike."""
        now = time.monotonic()
        start = now - max(float(seconds or 0.0), 0.0)
        with self._lock:
            self._token_events.append((start, now, int(prefill_tokens), int(decode_tokens)))
            self._earliest_start = min(self._earliest_start, start)
            self._totals["prefill"] += int(prefill_tokens)
            self._totals["decode"] += int(decode_tokens)

    def get_token_stats(self) -> dict:
        with self._lock:
            return self._token_stats_locked(time.monotonic())

    def _token_stats_locked(self, now: float) -> dict:
        lo = now - self._window_s
        while self._token_events and self._token_events[0][1] < lo:
            self._token_events.popleft()
        prefill = decode = 0.0
        for start, end, p, d in self._token_events:
            # Count only the part of each interval inside the window (a point counts whole).
            frac = 1.0 if end <= start else max(0.0, end - max(start, lo)) / (end - start)
            prefill, decode = prefill + p * frac, decode + d * frac
        # Aggregate wall-clock rate: over the window, or over the run so far while it is younger.
        span = now - max(lo, self._earliest_start)

        def rate(n: float) -> float:
            return n / span if span > 0 else 0.0

        total_p, total_d = self._totals["prefill"], self._totals["decode"]
        return {
            "window_s": self._window_s,
            "tokens_per_s": rate(prefill + decode),
            "prefill_tokens_per_s": rate(prefill),
            "decode_tokens_per_s": rate(decode),
            "total_prefill_tokens": total_p,
            "total_decode_tokens": total_d,
            "total_tokens": total_p + total_d,
        }

    # ---- timings ---------------------------------------------------------------------------------
    def report_training_step_time(self, step: int, seconds: float) -> None:
        self._report_time("training_step", step, seconds)

    def report_batch_generation_time(self, step: int, seconds: float) -> None:
        self._report_time("batch_generation", step, seconds)

    def _report_time(self, kind: str, step: int, seconds: float) -> None:
        with self._lock:
            t = self._timings.setdefault(kind, {"count": 0, "sum": 0.0})
            t["count"] += 1
            t["sum"] += float(seconds)
            t["last"], t["step"] = float(seconds), int(step)

    def get_timing_stats(self) -> dict:
        """{kind: {last, mean, count, step}} for kind in training_step, batch_generation."""
        with self._lock:
            return self._timing_stats_locked()

    def _timing_stats_locked(self) -> dict:
        return {
            kind: {
                "last": t["last"],
                "mean": t["sum"] / t["count"],
                "count": t["count"],
                "step": t["step"],
            }
            for kind, t in self._timings.items()
        }

    # ---- engines, metrics, progress --------------------------------------------------------------
    def set_kv_cache_max_concurrency(self, engine_id: int, value: float) -> None:
        with self._lock:
            self._kv_concurrency[int(engine_id)] = float(value)

    def set_startup(self, phases: list[dict]) -> None:
        """The start-up so far: StartupClock's phases ({"phase", "start_s", "end_s", "seconds"})."""
        with self._lock:
            self._startup = [dict(p) for p in phases]

    def report_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Append to the run's history; reports for the same step (in pieces) merge into one row."""
        row = {k: float(v) for k, v in metrics.items() if k != "step"}
        with self._lock:
            hist = self._metrics_history
            if hist and hist[-1]["step"] == step:
                hist[-1].update(row)
            else:
                hist.append({"step": int(step), **row})

    def report_progress(self, step: int, total_steps: int) -> None:
        """``step`` = steps completed so far; the ETA is (total_steps - step) x wall time per step."""
        with self._lock:
            entry = (time.monotonic(), int(step))
            self._progress = [self._progress[0], entry] if self._progress else [entry]
            self._total_steps = int(total_steps)

    # ---- asynchronous mode: staleness, busy fractions --------------------------------------------
    def report_staleness(self, step: int, counts: dict[int, int]) -> None:
        """Trajectories trained at ``step`` by staleness (0 = on-policy): ``{staleness: count}``.
        Adds to the run's histogram; ``last`` holds ``step``'s counts (reports for the same step,
        e.g. one per micro-batch, add up; a new step replaces them)."""
        step = _step(step)
        if not isinstance(counts, dict):
            raise ValueError(
                f"counts must be a dict {{staleness: count}}, got {type(counts).__name__}"
            )
        clean: dict[int, int] = {}
        for k, n in counts.items():  # all checked before anything is recorded
            if not _is_int(k) or k < 0:
                raise ValueError(f"counts: staleness must be an int >= 0, got {k!r}")
            if not _is_int(n) or n < 0:
                raise ValueError(f"counts: count for staleness {k} must be an int >= 0, got {n!r}")
            clean[int(k)] = int(n)
        with self._lock:
            if step != self._staleness_last_step:
                self._staleness_last, self._staleness_last_step = {}, step
            for k, n in clean.items():
                self._staleness_total[k] = self._staleness_total.get(k, 0) + n
                self._staleness_last[k] = self._staleness_last.get(k, 0) + n

    def report_busy(self, step: int, engine_fraction: float, trainer_fraction: float) -> None:
        """Fractions (0..1) of ``step``'s wall time the engines spent generating and the trainer
        computing. A second report for the same step replaces the first."""
        step = _step(step)
        for name, f in (
            ("engine_fraction", engine_fraction),
            ("trainer_fraction", trainer_fraction),
        ):
            real = isinstance(f, numbers.Real) and not isinstance(f, bool)
            if not (real and 0.0 <= f <= 1.0):  # NaN fails the comparison too
                raise ValueError(f"{name} must be a number in [0, 1], got {f!r}")
        fracs = (float(engine_fraction), float(trainer_fraction))
        with self._lock:
            if self._busy and self._busy[-1][0] == step:
                self._busy.pop()
            self._busy.append((step, *fracs))

    def _async_status_locked(self) -> dict:
        keys = lambda d: {str(k): d[k] for k in sorted(d)}  # noqa: E731  JSON keys are strings
        last = self._busy[-1] if self._busy else (None, None, None)
        return {
            "staleness": {
                "cumulative": keys(self._staleness_total),
                "last_step": self._staleness_last_step,
                "last": keys(self._staleness_last),
            },
            "busy": {
                "step": last[0],
                "engine": last[1],
                "trainer": last[2],
                "history": [list(h) for h in self._busy],
            },
        }

    # ---- queues ----------------------------------------------------------------------------------
    def register_queue(self, name: str, size_fn: Callable[[], int]) -> None:
        """Poll ``size_fn()`` every ``poll_interval_s`` (first poll right away)."""
        with self._lock:
            self._queue_fns[name] = size_fn
            self._queues[name] = {"size": None, "history": deque(maxlen=QUEUE_HISTORY_LEN)}
        self._poll_once({name: size_fn})

    def _poll_loop(self) -> None:
        while not self._stop_event.wait(self._poll_interval_s):
            with self._lock:
                fns = dict(self._queue_fns)
            self._poll_once(fns)

    def _poll_once(self, fns: dict[str, Callable[[], int]]) -> None:
        for name, fn in fns.items():
            try:  # outside the lock: a size_fn may be a slow remote call
                size, error = int(fn()), None
            except Exception as e:  # a broken queue must not kill the poller
                size, error = None, f"{type(e).__name__}: {e}"
            with self._lock:
                q = self._queues.get(name)
                if q is None:
                    continue
                q["size"], q["error"] = size, error
                if size is not None:
                    q["history"].append((round(time.monotonic() - self._t0, 3), size))

    # ---- the whole picture -----------------------------------------------------------------------
    def status(self, json_safe: bool = True) -> dict:
        """Everything the dashboard shows. JSON has no NaN, so by default non-finite floats become
        None; /metrics asks for the raw values (a NaN loss is worth an alert)."""
        with self._lock:
            now = time.monotonic()
            out = {
                "should_stop": self._should_stop,
                "uptime_s": now - self._t0,
                "tokens": self._token_stats_locked(now),
                "timings": self._timing_stats_locked(),
                "queues": {
                    n: {
                        "size": q["size"],
                        "error": q.get("error"),
                        "history": [list(h) for h in q["history"]],
                    }
                    for n, q in self._queues.items()
                },
                "kv_cache_max_concurrency": {
                    str(e): v for e, v in sorted(self._kv_concurrency.items())
                },
                "startup": [dict(p) for p in self._startup],
                "latest_metrics": dict(self._metrics_history[-1]) if self._metrics_history else {},
                "metrics_history": [dict(r) for r in self._metrics_history],
                "progress": self._progress_locked(),
                **self._async_status_locked(),
            }
        return _json_safe(out) if json_safe else out

    def _progress_locked(self) -> dict:
        if not self._progress:
            return {"step": None, "total_steps": None, "eta_s": None, "s_per_step": None}
        (t_first, s_first), (t_last, s_last) = self._progress[0], self._progress[-1]
        # Wall time per step between progress reports covers everything a step costs; before two
        # reports exist, fall back to the reported generation + training times.
        if s_last > s_first:
            per_step = (t_last - t_first) / (s_last - s_first)
        else:
            means = [t["sum"] / t["count"] for t in self._timings.values()]
            per_step = sum(means) if means else None
        left = max(self._total_steps - s_last, 0)
        return {
            "step": s_last,
            "total_steps": self._total_steps,
            "s_per_step": per_step,
            "eta_s": None if per_step is None else left * per_step,
        }

    # ---- dashboard -------------------------------------------------------------------------------
    def get_dashboard_port(self) -> int:
        """The bound port (never 0), or -1 when the dashboard is off or stopped."""
        return self._port if self._port is not None else -1

    def _start_dashboard(self, host: str, port: int, timeout_s: float = 15.0) -> None:
        import uvicorn  # here, so ActorManager(dashboard=False) needs neither uvicorn nor fastapi

        from rlmega.dashboard.app import make_app

        # Bind the socket ourselves: a port conflict raises here, and port 0 gives its real number.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(
            make_app(self),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._server_thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="rlmega-dashboard",
            daemon=True,
        )
        self._server_thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._server_thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"dashboard did not start on {host}:{port} within {timeout_s} s")
            time.sleep(0.01)
        self._port = sock.getsockname()[1]
        logger.info("rlmega dashboard: http://%s:%d/", host, self._port)

    def cleanup(self) -> None:
        """Stop the dashboard and the poller. Idempotent; the stats stay readable."""
        self._stop_event.set()
        with self._lock:  # swap under the lock: concurrent cleanups stop the server once
            server, thread = self._server, self._server_thread
            self._server = self._server_thread = None
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
        self._port = None
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join(timeout=10)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _step(step: Any) -> int:
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
