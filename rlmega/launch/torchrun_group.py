"""Trainer ranks as torchrun processes: rank 0 runs the driver loop, the other ranks serve it.

    python -m rlmega.launch.torchrun --nnodes N --nproc-per-node K -m rlmega.train CONFIG [key=value ...]

(torchrun itself works too, but its stores then listen on every interface: see launch/torchrun.py.)

Rollout engines and reward workers still run on Ray (rank 0 starts an embedded one, or attaches to
``cluster.address``). Where Roles would start a Ray ``WorkerGroup`` of trainer actors, under torchrun
it builds a ``TorchrunGroup``: the same ``call(method, *args)`` -> every rank's result, in rank order.

The channel is torchrun's own key-value store (the agent's TCPStore at MASTER_ADDR:MASTER_PORT,
which every rank already reaches): rank 0 puts command k under ``rlmega/cmd/k``; every rank runs it
on its MegatronActor and puts the result, or its error and traceback, under ``rlmega/res/k/RANK``.
Rank 0 runs its own share in a worker thread while its main thread watches the store, so a peer
that raised is reported at once by name ("trainer rank 2 raised ...") even while rank 0's share
waits for it in a collective, as the Ray launcher does (launch/errors.py).

Serving ranks ignore SIGINT, SIGTERM and SIGUSR1: a Ctrl-C, ``scancel`` or a time-limit warning is
rank 0's to act on (finish the step, checkpoint, release everyone), and it needs its peers for
that. They leave on rank 0's exit command, or when torchrun tears the job down (SIGKILL after its
grace period, when any rank dies).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any

from rlmega.process.bound_store import BOUND_ENV
from rlmega.process.heap import imports_uncollected
from rlmega.launch.rank_imports import keep_out_unused
from rlmega.launch.worker_group import WorkerGroupError, first_rank_of

log = logging.getLogger("rlmega")

# How rank 0 authenticates to Ray; the serving ranks connect the same way.
RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def rank() -> int | None:
    """This process's torchrun rank, or None when torchrun did not start it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"])


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def _store(timeout_s: float = 300.0):
    import torch.distributed as dist

    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): every rank is a client.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # A restarted job (torchrun --max-restarts) starts a fresh conversation in the same store.
    return dist.PrefixStore(f"rlmega/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _ready(store, key: str) -> bool:
    return store.check([key])


def _take(store, key: str) -> Any:
    value = pickle.loads(store.get(key))
    store.delete_key(key)
    return value


def _outcome(fn, *args, **kwargs) -> tuple:
    """("ok", result) or ("error", exception or None, "Type: message", traceback text)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except BaseException as e:  # everything goes back to rank 0, which decides
        try:
            pickle.dumps(e)
        except Exception:  # an exception that does not pickle travels as text only
            e = None
        return (
            "error",
            e,
            f"{type(e).__name__ if e else 'Exception'}: {e}",
            traceback.format_exc(),
        )


class _Host:
    """One rank's worker object and the calls on it."""

    def __init__(self):
        self.worker = None
        # this rank's client of the store, made when a sharded call first needs it
        self.store = None

    def run(self, command: tuple) -> Any:
        kind, payload = command
        if kind == "ray":  # connect before any later command unpickles Ray handles (transports)
            import ray

            address, env = payload
            # Rank 0's Ray auth mode: the Ray it started wants the token (~/.ray/auth_token). Ray reads
            # the mode into a cached config at import; re-read it as ray.init does for its own cluster.
            if env:
                os.environ.update(env)
                from ray._raylet import Config  # type: ignore[attr-defined]

                Config.initialize("")
            if not ray.is_initialized():
                ray.init(address=address, log_to_driver=False)
            return None
        if kind == "build":
            cls, args, kwargs = payload
            # the backend's imports, as a Ray rank host's (rlmega/process/heap.py)
            with imports_uncollected():
                self.worker = cls(*args, **kwargs)
            return None
        # this rank's share is under its own key (TorchrunGroup.submit_shards)
        if kind == "call_shards":
            method, key, dp_of_rank, args, kwargs = payload
            me = rank() or 0
            self.store = self.store or _store()
            shard = pickle.loads(self.store.get(f"{key}/{dp_of_rank[me]}"))
            out = getattr(self.worker, method)(shard, *args, **kwargs)
            return out if first_rank_of(dp_of_rank)[dp_of_rank[me]] == me else None
        method, args, kwargs = payload
        out = getattr(self.worker, method)(*args, **kwargs)
        return None if kind == "call_rank0" and rank() else out  # see TorchrunGroup.call_rank0


def serve(poll_s: float = 0.02) -> int:
    """Ranks 1..: run rank 0's commands until it says exit; return the exit code it sends."""
    keep_out_unused()  # before any command builds a worker (launch/rank_imports.py)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    me, store, host = rank(), _store(), _Host()
    k = 0
    while True:
        key = f"cmd/{k}"
        while not _ready(store, key):
            if _ready(store, "exit"):
                return int(pickle.loads(store.get("exit")))
            time.sleep(poll_s)
        command = pickle.loads(store.get(key))  # rank 0 deletes it once every rank answered
        store.set(f"res/{k}/{me}", pickle.dumps(_outcome(host.run, command)))
        k += 1


class TorchrunGroup:
    """Rank 0's handle on all trainer ranks (itself included); the interface of launch.WorkerGroup.

    ``__init__`` connects the serving ranks to Ray at ``ray_address`` (if given) and builds ``cls(*args,
    **kwargs)`` on every rank. Call ``close(code)`` to release the serving ranks."""

    def __init__(
        self,
        cls,
        world_size_: int,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        ray_address: str | None,
        timeout_s: float = 1800.0,
    ):
        if world_size() != world_size_:
            raise RuntimeError(
                f"torchrun started {world_size()} processes but parallelism.world_size is "
                f"{world_size_}: start torchrun with --nnodes x --nproc-per-node = {world_size_}"
            )
        self.world_size, self.timeout_s = world_size_, timeout_s
        if os.environ.get(BOUND_ENV) != "1":
            log.warning(
                "torchrun's key-value stores listen on every interface with no authentication, and "
                "they carry the ranks' commands (pickles): launch with `python -m rlmega.launch.torchrun` "
                "(the same arguments) to keep them on this group's address (docs/launching.md)"
            )
        self.store, self.k = _store(), 0
        self._host = _Host()
        # One thread runs every local call: the CUDA device a rank binds to is per thread.
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="trainer-rank-0", daemon=True)
        self._thread.start()
        # the ranks send weights to Ray actors (RayTransport): they join rank 0's Ray
        if ray_address:
            self._send(
                ("ray", (ray_address, {k: v for k, v in os.environ.items() if k in RAY_AUTH_ENV}))
            )
        self._send(("build", (cls, tuple(args), kwargs or {})))

    def _work(self) -> None:
        while True:
            command, box = self._jobs.get()
            box.put(_outcome(self._host.run, command))

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank with the same arguments; results in rank order."""
        return self._send(("call", (method, args, kwargs)))

    def call_rank0(self, method: str, *args, **kwargs) -> Any:
        """``call``, but only rank 0's result is kept: the others store None through the TCPStore
        (every rank returns the same full result; see WorkerGroup.call_rank0)."""
        return self._send(("call_rank0", (method, args, kwargs)))[0]

    def submit_shards(self, method: str, shards: list, dp_of_rank: list[int], *args, **kwargs):
        """WorkerGroup.submit_shards through the store: each data-parallel rank's share under a key of its
        own, read only by its ranks. Runs now; returns the function that gives the results."""
        key = f"shards/{self.k}"
        for d, shard in enumerate(shards):
            self.store.set(f"{key}/{d}", pickle.dumps(shard))
        try:
            out = self._send(("call_shards", (method, key, list(dp_of_rank), args, kwargs)))
        finally:
            for d in range(len(shards)):
                self.store.delete_key(f"{key}/{d}")
        first = first_rank_of(dp_of_rank)
        return lambda: [out[first[d]] for d in range(len(shards))]

    def _send(self, command: tuple) -> list:
        k, self.k = self.k, self.k + 1
        self.store.set(f"cmd/{k}", pickle.dumps(command))
        mine: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((command, mine))
        results: dict[int, tuple] = {}
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while len(results) < self.world_size:
            if 0 not in results and not mine.empty():
                results[0] = mine.get()
            for r in range(1, self.world_size):
                if r not in results and _ready(self.store, f"res/{k}/{r}"):
                    results[r] = _take(self.store, f"res/{k}/{r}")
            failed = [r for r, out in sorted(results.items()) if out[0] == "error"]
            # report the first failure at once: its peers may wait for it in a collective
            if failed:
                _, cause, what, tb = results[failed[0]]
                raise WorkerGroupError(
                    f"trainer rank {failed[0]} raised {what}",
                    f"trainer rank {failed[0]}",
                    cause,
                    tb,
                )
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in results]
                raise WorkerGroupError(
                    f"trainer ranks {missing} did not answer within {self.timeout_s:.0f}s",
                    "trainer ranks",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self.store.delete_key(f"cmd/{k}")
        return [results[r][1] for r in range(self.world_size)]

    def shutdown(self, code: int = 0) -> None:
        release_ranks(code, self.store)


def release_ranks(code: int = 0, store=None) -> None:
    """Rank 0: tell the serving ranks to exit with ``code`` (idempotent; safe before any group exists)."""
    store = store or _store()
    if not _ready(store, "exit"):
        store.set("exit", pickle.dumps(code))
