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

from collections import Counter


def share(cpus: float, processes: int) -> int:
    """Threads for each of ``processes`` processes taking turns on ``cpus`` CPUs: >= 1."""
    return max(1, int(cpus) // max(1, processes))


def per_process(nodes: list[str], node_cpus: dict[str, float]) -> list[int]:
    """Threads of each process, given the node each one runs on and the CPUs of each node.

    per_process(["a", "a", "b"], {"a": 4, "b": 2}) == [2, 2, 2]
    """
    count = Counter(nodes)
    return [share(node_cpus.get(n, 1), count[n]) for n in nodes]
