"""Run a function on N real processes (ranks) with a hard deadline.

    results = run_on_ranks(body, world_size=4, args=(tmp_dir,), timeout_s=300)

Each rank is a fresh process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, as torchrun would, so the body can call ``rlmega.megatron.runtime.init_megatron``.
``body`` must be importable (a module-level function).

Ranks are forked from a ``forkserver`` that imported torch, transformers and megatron.core once
(``PRELOAD``): a ``spawn``ed rank spent ~7 s of CPU importing them, every rank of every call, which
on the 2-core CI machine was most of the multi-rank tests' time. The server only imports modules (no
process group, no CUDA context, no Megatron state: those come with init_megatron in the rank), and
rlmega itself is imported by each rank, fresh. ``start_method="spawn"`` gives the old behaviour: use
it for ranks that use CUDA (tests/gpu), as an import may have touched the CUDA driver in the server.

A collective whose peer has died blocks forever, so the parent never waits on ranks blindly:
the first rank that raises ends the run (the others are killed) with that rank's traceback,
a rank that dies without reporting (segfault, ``os._exit``) ends it with its exit code, and
the deadline kills everything and names the ranks that were still running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence


class RankFailed(RuntimeError):
    """A rank raised, died, or missed the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver (see the module docstring), with the collector off, then frozen
# (rlmega/testing/rank_preload.py, the server's one preload); third-party only, so rlmega's own code (but
# this module and that one) is imported by each rank as it is now.
WARM = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
]
PRELOAD = ["rlmega.testing.rank_preload"]


class _ParentStdio:
    """The parent's stdout and stderr as they are when a rank starts, handed to the rank.

    A spawned rank inherits them; a forked one inherits the forkserver's, i.e. those of the test
    that happened to start the server (pytest captures each test's output in its own file). The
    rank puts these on its fds 1 and 2, so a rank's prints and crash messages land with the test
    that ran it, as before. Pickled only while the rank is being started (multiprocessing's DupFd).
    """

    def __reduce__(self):
        from multiprocessing import reduction

        return tuple, ([reduction.DupFd(1), reduction.DupFd(2)],)


class _ListeningFd:
    """Rank 0's store socket, made listening by the parent and handed over (multiprocessing's DupFd).

    A port found free and let go is anyone's until rank 0 binds it, seconds later after its imports:
    CI of 2026-12-07 lost a run to EADDRINUSE that way (tests/multiproc/test_moe_layouts.py). Listening
    from the parent's choice on, nothing else can bind it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt_fd, (reduction.DupFd(self.sock.fileno()),)


def _adopt_fd(dup) -> int:
    from rlmega.process.bound_store import adopt_listening

    return adopt_listening(socket.socket(fileno=dup.detach()))


def _rank_main(
    body, rank, world_size, port, args, kwargs, env, results, stdio=None, adopted_port=None
):
    # adopted_port: rank 0's store socket, adopted by bound_store as it was unpickled (_ListeningFd)
    if stdio is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, wrapped in zip((1, 2), stdio):
            fd = wrapped.detach()
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        # A preloaded torch read OMP_NUM_THREADS in the forkserver, where this env was not set.
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        out = body(*args, **kwargs)
        # Pickle by value here: through the queue torch would share tensors by file
        # descriptor, which dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(
    body: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``body(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first call)
    results = ctx.Queue()
    from rlmega.process.bound_store import listening_socket

    store_socket = listening_socket("127.0.0.1", 0)  # rank 0's, handed to it (_ListeningFd)
    port = store_socket.getsockname()[1]
    # One intra-op thread per rank: the machines have 2 cores and N ranks share them.
    rank_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                body,
                r,
                world_size,
                port,
                tuple(args),
                kwargs or {},
                rank_env,
                results,
                _ParentStdio() if start_method == "forkserver" else None,
                _ListeningFd(store_socket) if r == 0 else None,
            ),
            name=f"rank{r}",
            # Not daemonic: ranks may start helpers of their own (Megatron's checkpoint
            # writer does). The finally-block below kills them instead.
            daemon=False,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        store_socket.close()  # rank 0 holds its own copy from here on
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive() and p.exitcode not in (None, 0):
                        raise RankFailed(
                            f"rank {r} died with exit code {p.exitcode} before reporting"
                        )
                if time.monotonic() > deadline:
                    pending = sorted(set(range(world_size)) - set(out))
                    raise RankFailed(
                        f"timed out after {timeout_s:.0f}s; ranks still running: {pending}"
                    )
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} raised:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]
