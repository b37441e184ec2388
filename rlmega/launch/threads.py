"""How many intra-op threads (torch.set_num_threads) each trainer rank and rollout engine gets.

The RL loop is synchronous: engines generate while the trainer ranks wait, then the ranks compute
log-probs and train while the engines wait. So on a CPU node each phase may use every core the
node gives Ray: a rank gets the node's CPUs / the ranks on that node, an engine the node's CPUs /
the engines on it (each at least 1). Forcing one thread per rank left half of a 2-core machine
idle at world size 1. With GPUs the ranks keep one host thread (torchrun's default): their work
runs on the device. ``cluster.threads_per_rank`` / ``cluster.threads_per_engine`` override.
Asynchronous production (produce.strategy=async) generates while the ranks train: there ranks and
engines share a node's CPUs, every process of either kind counted (launch/roles.py).
"""

from __future__ import annotations

import logging
import os
from collections import Counter

from rlmega.config.schema import RLConfig

log = logging.getLogger("rlmega")


def share(cpus: float, processes: int) -> int:
    """Threads for each of ``processes`` processes taking turns on ``cpus`` CPUs: >= 1."""
    return max(1, int(cpus) // max(1, processes))


def per_process(nodes: list[str], node_cpus: dict[str, float]) -> list[int]:
    """Threads of each process, given the node each one runs on and the CPUs of each node.

    per_process(["a", "a", "b"], {"a": 4, "b": 2}) == [2, 2, 2]
    """
    count = Counter(nodes)
    return [share(node_cpus.get(n, 1), count[n]) for n in nodes]


def plan(
    cfg: RLConfig,
    rank_nodes: list[str],
    engine_nodes: list[str],
    node_cpus: dict[str, float],
    on_torchrun: bool,
    engines_awake_while_training: bool,
) -> tuple[int, list]:
    """Intra-op threads of the trainer ranks (one number: every rank gets the same) and of each
    engine (None: vLLM's own workers, TP > 1 or CUDA), given the node of each rank and engine and
    the CPUs of each node."""
    c, r = cfg.cluster, cfg.rollout
    if c.threads_per_rank is not None:
        rank = c.threads_per_rank
    elif r.device == "cuda":
        rank = 1
    elif on_torchrun:  # the ranks are torchrun's, on nodes like this one
        rank = share(len(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # async: ranks and engines compute at the same time, sharing the node
    elif engines_awake_while_training:
        rank = min(per_process(rank_nodes + engine_nodes, node_cpus)[: len(rank_nodes)])
    else:
        rank = min(per_process(rank_nodes, node_cpus))
    if r.device == "cuda" or r.tensor_parallel_size > 1:
        engines: list[int | None] = [None] * len(engine_nodes)
    elif c.threads_per_engine is not None:
        engines = [c.threads_per_engine] * len(engine_nodes)
    elif engines_awake_while_training:
        engines = per_process(rank_nodes + engine_nodes, node_cpus)[len(rank_nodes) :]
    else:
        engines = per_process(engine_nodes, node_cpus)
    log.info("intra-op threads: %d per trainer rank, %s per engine", rank, engines)
    return rank, engines
