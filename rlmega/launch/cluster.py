"""Ray for one run: start an embedded Ray or attach to a cluster, put the plan's groups on nodes, and
check that the nodes see the run's folders.

    started = connect(cfg.cluster, needed_cpus)       # True: an embedded Ray this process must shut down
    pgs, nodes = place_groups(plan, timeout_s=120)    # nodes[g][b]: Ray node id of bundle b of group g
    check_shared_paths(run_dir, model_path, trainer_nodes, engine_nodes)   # ClusterError naming the nodes

Attached to a cluster (``cluster.address``), workers on other nodes get this process's rlmega package
and the variables ``cluster.forward_env`` names (``runtime_env``), and their output reaches this
process's console (``log_to_driver``). Roles calls all of these; tests call them to probe placement.
"""

from __future__ import annotations

import math
import os
import secrets
import time

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

import rlmega
from rlmega.config.placement_plan import PlacementPlan


class ClusterError(RuntimeError):
    """The cluster cannot host the run as configured (too few nodes, folders not shared); the message
    names the config field or node and the fix."""


def runtime_env(forward_env: list[str], environ=os.environ) -> dict:
    """The job's runtime_env when attached to a cluster.

    ``py_modules``: Ray zips this process's rlmega package (about 0.5 MB, uploaded once per content
    hash) and every worker imports it from its node's runtime_resources cache, ahead of an rlmega on
    the node's PYTHONPATH or site-packages. Chosen over ``env_vars: PYTHONPATH=<checkout>`` because it
    needs no shared filesystem for the code. One catch, Ray's: it also puts the driver's working
    directory first on every worker's sys.path, so a node holding another rlmega at that same path
    imports that one; start the driver from a checkout on a shared filesystem, or from a folder without
    rlmega in it. Third-party packages (torch, megatron-core, vllm) are not shipped: every node needs
    them installed (the same image); pip per run would take minutes.
    ``env_vars``: those of ``forward_env`` set here; a remote worker inherits its raylet's environment,
    not the driver's.
    """
    return {
        "py_modules": [os.path.dirname(os.path.abspath(rlmega.__file__))],
        "excludes": ["__pycache__/", "*.pyc"],
        "env_vars": {k: environ[k] for k in forward_env if k in environ},
    }


def connect(c, needed_cpus: float) -> bool:
    """ray.init for the ``cluster`` section; True when it started an embedded Ray (the caller shuts it down).

    Attached, worker output (errors included) is forwarded to this console: it is written on other
    machines, where the user may not look or have access. Embedded, it is not: it stays in this
    machine's /tmp/ray/session_latest/logs/, and forwarding it adds ~175 lines of vLLM and Megatron
    start-up chatter to a tiny run's console, around the progress bar. Start-up takes the same
    either way (measured here, 3 runs each: 2.4-4.1 s forwarded, 3.5-7.5 s not: noise).
    """
    if c.address:
        ray.init(address=c.address, runtime_env=runtime_env(c.forward_env), log_to_driver=True)
        return False
    # Ray CPUs are reservations, not cores: an embedded cluster declares at least what the roles
    # reserve, so a 2-core laptop runs the same layout a cluster would (slower).
    # address="local": a new Ray of our own, even when `ray start` left a cluster on this
    # machine (with no address, ray.init would attach to it).
    ray.init(
        address="local",
        num_cpus=c.num_cpus or max(os.cpu_count() or 1, math.ceil(needed_cpus)),
        include_dashboard=False,
        log_to_driver=False,
    )
    return True


def place_groups(plan: PlacementPlan, timeout_s: float) -> tuple[list, list[list[str]]]:
    """Ray placement groups for ``plan.groups`` and the node id of each bundle.

    STRICT_PACK keeps each group on one node, but Ray would happily put two groups on one node that can
    hold both; a plan whose groups are nodes therefore asks Ray, by label selector, for a node no earlier
    group holds. Groups are placed one after the other for that reason (milliseconds each). On failure
    the groups made so far are removed and ClusterError says what did not fit.
    """
    alive = [n for n in ray.nodes() if n["Alive"]]
    if plan.one_node_per_group and len(plan.groups) > len(alive):
        raise ClusterError(
            f"the placement needs {len(plan.groups)} nodes (one per group of cluster.gpus_per_node GPUs or "
            f"cluster.cpu_ranks_per_node ranks), the cluster has {len(alive)}. Fix: raise "
            "cluster.gpus_per_node / cluster.cpu_ranks_per_node, lower parallelism.world_size, or add nodes"
        )
    pgs: list = []
    nodes: list = []
    deadline = time.monotonic() + timeout_s
    try:
        for g, bundles in enumerate(plan.groups):
            taken = (
                sorted({n for group in nodes for n in group.values()})
                if plan.one_node_per_group
                else []
            )
            selector = (
                [{NODE_ID_LABEL_KEY: f"!in({','.join(taken)})"}] * len(bundles) if taken else None
            )
            pgs.append(
                placement_group(bundles, strategy=plan.strategy, bundle_label_selector=selector)
            )
            try:
                ray.get(pgs[-1].ready(), timeout=max(deadline - time.monotonic(), 1))
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"Ray could not place group {g} of {len(plan.groups)} {bundles} ({plan.strategy}"
                    f"{', on a node of its own' if plan.one_node_per_group else ''}) within {timeout_s:.0f}s; "
                    f"free per node: {_free_per_node()}. Fix: lower cluster.*_cpus, check cluster.gpus_per_node "
                    "/ cluster.cpu_ranks_per_node, or give the cluster more resources (cluster.num_cpus for "
                    "the embedded one)"
                ) from None
            nodes.append(placement_group_table(pgs[-1])["bundles_to_node_id"])
    except BaseException:
        for pg in pgs:
            remove_placement_group(pg)
        raise
    return pgs, [[group[b] for b in range(len(group))] for group in nodes]


def _free_per_node() -> dict:
    return {
        f"{n['NodeID'][:8]} ({n['NodeManagerAddress']})": {
            k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")
        }
        for n in ray.nodes()
        if n["Alive"]
    }


def node_names(node_ids: list[str]) -> list[str]:
    """'<first 8 hex of the id> (<ip>)' for each Ray node id: the form the log and errors use."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [f"{i[:8]} ({ips.get(i, '?')})" for i in node_ids]


@ray.remote(num_cpus=0)
def _look(run_dir_token: str, model_config: str) -> tuple[str | None, bool]:
    """On one node: the token file's content (None if unreadable) and whether the model is there."""
    try:
        with open(run_dir_token) as f:
            token = f.read()
    except OSError:
        token = None
    return token, os.path.isfile(model_config)


def check_shared_paths(
    run_dir: str,
    model_path: str,
    trainer_nodes: list[str],
    engine_nodes: list[str],
    timeout_s: float = 120.0,
) -> None:
    """Every node hosting a trainer rank sees ``run_dir`` (checkpoints are written by every rank), and
    every node hosting a rank or an engine sees ``model_path``; ClusterError naming the nodes otherwise.

    A token with a random value, written here into run_dir, is read back by a task pinned to each other
    node: an existing folder of the same name on a node's local disk does not pass. The driver's own
    node is not asked (it wrote the token)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((set(trainer_nodes) | set(engine_nodes)) - {here})
    if not nodes:
        return
    token = secrets.token_hex(16)
    path = os.path.join(os.path.abspath(run_dir), f".rlmega-node-check-{token[:8]}")
    model_config = os.path.join(os.path.abspath(model_path), "config.json")
    with open(path, "w") as f:
        f.write(token)
    try:
        seen = ray.get(
            [
                _look.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)
                ).remote(path, model_config)
                for n in nodes
            ],
            timeout=timeout_s,
        )
    finally:
        os.remove(path)
    no_run_dir = [n for n, (got, _) in zip(nodes, seen) if got != token and n in trainer_nodes]
    no_model = [n for n, (_, has) in zip(nodes, seen) if not has]
    problems = []
    if no_run_dir:
        problems.append(
            f"trainer.run_dir: {os.path.abspath(run_dir)} is not the same folder on node(s) "
            f"{', '.join(node_names(no_run_dir))}, which host trainer ranks (a file written there here cannot be "
            "read there). Fix: put trainer.run_dir on a filesystem every node mounts at the same path "
            "(NFS, Lustre, ...)"
        )
    if no_model:
        problems.append(
            f"model.path: {model_config} is missing on node(s) {', '.join(node_names(no_model))}. Fix: put "
            "model.path on a filesystem every node mounts, or copy the model to the same path on every node"
        )
    if problems:
        raise ClusterError("; ".join(problems))
