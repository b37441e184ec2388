"""Run a function on N real processes (ranks) with a hard deadline.

    results = run_on_ranks(body, world_size=4, args=(tmp_dir,), timeout_s=300)

Each rank is a fresh ``spawn`` process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun would, so the body can call
``rlmega.megatron.runtime.init_megatron``. ``body`` must be importable (a module-level function).

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
import time
import traceback
from typing import Any, Callable, Sequence


class RankFailed(RuntimeError):
    """A rank raised, died, or missed the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(body, rank, world_size, port, args, kwargs, env, results):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
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
) -> list[Any]:
    """Run ``body(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # One intra-op thread per rank: the machines have 2 cores and N ranks share them.
    rank_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(body, r, world_size, port, tuple(args), kwargs or {}, rank_env, results),
            name=f"rank{r}",
            # Not daemonic: ranks may start helpers of their own (Megatron's checkpoint
            # writer does). The finally-block below kills them instead.
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive() and p.exitcode not in (None, 0):
                        raise RankFailed(f"rank {r} died with exit code {p.exitcode} before reporting")
                if time.monotonic() > deadline:
                    pending = sorted(set(range(world_size)) - set(out))
                    raise RankFailed(f"timed out after {timeout_s:.0f}s; ranks still running: {pending}")
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
