"""Placement plans (rlmega.config.placement_plan) of the shipped GPU configs and of CPU runs, checked rank by rank."""

import json
from collections import Counter
from pathlib import Path

import pytest

from rlmega.config import load_config
from rlmega.config.placement_plan import PlacementError, placement_plan
from rlmega.config.schema import ClusterConfig, ParallelismConfig, RolloutConfig

# pytest puts tests/unit on sys.path
from test_gpu_configs import LLAMA3_8B, QWEN2_7B, QWEN3_30B_A3B

ROOT = Path(__file__).resolve().parents[2]


def _load(tmp_path, name, hf, *overrides):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return load_config(
        ROOT / "configs" / name,
        [
            f"model.path={tmp_path}",
            "data.train_path=''",
            "data.eval_path=''",
            f"trainer.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def _check_gpu_sharing(plan, engine_workers_per_gpu):
    """Every GPU holds exactly one trainer rank and engine_workers_per_gpu engine TP workers; every
    bundle asks Ray for exactly one GPU; the fractions on one GPU add up to at most one."""
    ranks = Counter(g for s in plan.ranks for g in plan.gpus(s))
    engines = Counter(g for s in plan.engines for g in plan.gpus(s))
    all_gpus = {(n, b) for n, group in enumerate(plan.groups) for b, bundle in enumerate(group)}
    assert all(bundle["GPU"] == 1 for group in plan.groups for bundle in group)
    for gpu in all_gpus:
        load = ranks[gpu] * plan.ranks[0].gpus + engines[gpu] * (
            plan.engines[0].gpus if plan.engines else 0
        )
        assert load <= 1.0, gpu
    assert set(ranks.values()) == {1}
    assert set(engines.values()) <= {engine_workers_per_gpu}


def test_qwen2_7b_two_nodes_colocated(tmp_path):
    cfg = _load(tmp_path, "qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B)
    plan = placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster)
    assert plan.strategy == "STRICT_PACK" and [len(g) for g in plan.groups] == [8, 8]
    # Trainer rank r: node r // 8, GPU r % 8, half of it (the engine takes the other half).
    assert [(s.group, s.bundles) for s in plan.ranks] == [(r // 8, (r % 8,)) for r in range(16)]
    assert {s.gpus for s in plan.ranks} == {0.5}
    # 8 engines of vLLM TP2: alternate nodes, two adjacent GPUs of one node each.
    assert [(s.group, s.bundles) for s in plan.engines] == [
        (0, (0, 1)),
        (1, (0, 1)),
        (0, (2, 3)),
        (1, (2, 3)),
        (0, (4, 5)),
        (1, (4, 5)),
        (0, (6, 7)),
        (1, (6, 7)),
    ]
    assert {s.gpus for s in plan.engines} == {0.5}
    _check_gpu_sharing(plan, engine_workers_per_gpu=1)
    # CPUs: a rank's 4 on every bundle, an engine's 2 on its first bundle.
    assert [b["CPU"] for b in plan.groups[0]] == [6, 4, 6, 4, 6, 4, 6, 4]


def test_llama3_8b_one_node_colocated_and_separate(tmp_path):
    cfg = _load(tmp_path, "llama3_8b_tp2pp2vpp2.yaml", LLAMA3_8B)
    plan = placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster)
    assert [len(g) for g in plan.groups] == [8]
    assert [(s.group, s.bundles, s.gpus) for s in plan.ranks] == [(0, (r,), 0.5) for r in range(8)]
    assert [(s.group, s.bundles) for s in plan.engines] == [
        (0, (0, 1)),
        (0, (2, 3)),
        (0, (4, 5)),
        (0, (6, 7)),
    ]
    _check_gpu_sharing(plan, engine_workers_per_gpu=1)

    # The layout its header describes with cluster.colocate=false: engines on a second node of their own.
    cfg = _load(tmp_path, "llama3_8b_tp2pp2vpp2.yaml", LLAMA3_8B, "cluster.colocate=false")
    plan = placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster)
    assert [len(g) for g in plan.groups] == [8, 8]
    assert [(s.group, s.bundles, s.gpus) for s in plan.ranks] == [(0, (r,), 1.0) for r in range(8)]
    assert [(s.group, s.bundles, s.gpus) for s in plan.engines] == [
        (1, (0, 1), 1.0),
        (1, (2, 3), 1.0),
        (1, (4, 5), 1.0),
        (1, (6, 7), 1.0),
    ]
    assert plan.groups[1] == [{"GPU": 1, "CPU": 0.5}, {"GPU": 1}] * 4


def test_qwen3_30b_a3b_two_nodes_each_expert_group_on_one_node(tmp_path):
    """TP1 x EP8 x PP2: megatron-core's expert-parallel groups are ranks 0-7 and 8-15 (its tp-cp-ep-dp-pp
    order; checked against initialize_model_parallel in tests/unit/test_config.py), so with ranks filling
    nodes in order each group's all-to-all stays inside one node; 4 engines of vLLM TP4, one per half node."""
    cfg = _load(tmp_path, "qwen3_30b_a3b_ep8pp2_2nodes.yaml", QWEN3_30B_A3B)
    plan = placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster)
    assert plan.strategy == "STRICT_PACK" and [len(g) for g in plan.groups] == [8, 8]
    assert [(s.group, s.bundles) for s in plan.ranks] == [(r // 8, (r % 8,)) for r in range(16)]
    ep = cfg.parallelism.expert_model_parallel_size * cfg.parallelism.tensor_model_parallel_size
    assert all(len({plan.ranks[r].group for r in range(g, g + ep)}) == 1 for g in range(0, 16, ep))
    assert [(s.group, s.bundles) for s in plan.engines] == [
        (0, (0, 1, 2, 3)),
        (1, (0, 1, 2, 3)),
        (0, (4, 5, 6, 7)),
        (1, (4, 5, 6, 7)),
    ]
    _check_gpu_sharing(plan, engine_workers_per_gpu=1)


def test_an_engine_tp_group_never_spans_nodes():
    # 2 nodes of 4 GPUs, colocated engines of TP 3: one per node fits, a third would straddle.
    par, clu = ParallelismConfig(world_size=8), ClusterConfig(gpus_per_node=4)
    plan = placement_plan(
        par, RolloutConfig(device="cuda", num_engines=2, tensor_parallel_size=3), clu
    )
    assert [(s.group, s.bundles) for s in plan.engines] == [(0, (0, 1, 2)), (1, (0, 1, 2))]
    with pytest.raises(PlacementError, match="rollout.num_engines: 3 colocated engines"):
        placement_plan(
            par, RolloutConfig(device="cuda", num_engines=3, tensor_parallel_size=3), clu
        )


def test_trainer_ranks_fill_whole_nodes_and_engines_alternate_nodes():
    # 12 ranks: a full node and half of another; Megatron's TP groups (3 ranks) would straddle nodes.
    plan = placement_plan(
        ParallelismConfig(world_size=12), RolloutConfig(device="cuda"), ClusterConfig()
    )
    assert [len(g) for g in plan.groups] == [8, 4] and plan.ranks[11].group == 1
    with pytest.raises(
        PlacementError, match="parallelism.tensor_model_parallel_size: Megatron TP groups of 3"
    ):
        placement_plan(
            ParallelismConfig(tensor_model_parallel_size=3, world_size=12),
            RolloutConfig(device="cuda"),
            ClusterConfig(),
        )
    plan = placement_plan(
        ParallelismConfig(world_size=16),
        RolloutConfig(device="cuda", num_engines=3),
        ClusterConfig(),
    )
    assert [(s.group, s.bundles) for s in plan.engines] == [(0, (0,)), (1, (0,)), (0, (1,))]


def test_cpu_plan_is_one_pack_group_without_gpus():
    plan = placement_plan(
        ParallelismConfig(world_size=2),
        RolloutConfig(num_engines=3),
        ClusterConfig(actor_cpus_per_rank=0.5, engine_cpus=0.25),
    )
    assert plan.strategy == "PACK" and plan.groups == [[{"CPU": 1.0}, {"CPU": 0.75}]]
    assert [s.bundles for s in plan.engines] == [(0,), (1,), (0,)]
    assert all(s.gpus == 0 for s in plan.ranks + plan.engines)
    plan = placement_plan(
        ParallelismConfig(world_size=2), RolloutConfig(num_engines=1), ClusterConfig(colocate=False)
    )
    assert plan.groups == [[{"CPU": 0.5}] * 3] and plan.engines[0].bundles == (2,)


def test_a_layout_that_cannot_be_placed_fails_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match="rollout.num_engines: 9 colocated engines"):
        _load(tmp_path, "qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B, "rollout.num_engines=9")


def test_cpu_ranks_per_node_makes_one_group_per_node_and_spreads_engines():
    # 4 ranks of TP2, 2 per node: each TP group (ranks 0-1, 2-3) is one node; 3 engines alternate nodes.
    par, roll = (
        ParallelismConfig(tensor_model_parallel_size=2, world_size=4),
        RolloutConfig(num_engines=3),
    )
    plan = placement_plan(
        par, roll, ClusterConfig(cpu_ranks_per_node=2, actor_cpus_per_rank=0.5, engine_cpus=0.25)
    )
    assert plan.strategy == "STRICT_PACK" and plan.one_node_per_group
    assert [(s.group, s.bundles) for s in plan.ranks] == [
        (0, (0,)),
        (0, (1,)),
        (1, (0,)),
        (1, (1,)),
    ]
    assert [(s.group, s.bundles) for s in plan.engines] == [(0, (0,)), (1, (0,)), (0, (1,))]
    assert plan.groups == [[{"CPU": 0.75}, {"CPU": 0.75}], [{"CPU": 0.75}, {"CPU": 0.5}]]
    assert all(s.gpus == 0 for s in plan.ranks + plan.engines)
    # not colocated: each engine a bundle of its own on its node; vLLM TP does not change a CPU engine's bundle
    plan = placement_plan(
        par,
        RolloutConfig(num_engines=2, tensor_parallel_size=2),
        ClusterConfig(cpu_ranks_per_node=2, colocate=False),
    )
    assert [(s.group, s.bundles) for s in plan.engines] == [(0, (2,)), (1, (2,))]
    assert [len(g) for g in plan.groups] == [3, 3]
    # no Ray trainer ranks (torchrun's ranks): the engines alone, in one group
    plan = placement_plan(
        ParallelismConfig(world_size=0),
        RolloutConfig(num_engines=2),
        ClusterConfig(cpu_ranks_per_node=2, colocate=False),
    )
    assert plan.ranks == [] and plan.groups == [[{"CPU": 0.5}, {"CPU": 0.5}]]
    # the default keeps the single PACK group, which Ray may put on any node
    assert not placement_plan(par, roll, ClusterConfig()).one_node_per_group


def test_cpu_ranks_per_node_refuses_tp_groups_across_nodes_and_gpu_runs():
    with pytest.raises(
        PlacementError,
        match="TP groups of 2 ranks would span nodes of cluster.cpu_ranks_per_node=3",
    ):
        placement_plan(
            ParallelismConfig(tensor_model_parallel_size=2, world_size=6),
            RolloutConfig(),
            ClusterConfig(cpu_ranks_per_node=3),
        )
    with pytest.raises(
        PlacementError, match="cluster.cpu_ranks_per_node: 2 applies to CPU runs only"
    ):
        placement_plan(
            ParallelismConfig(world_size=4),
            RolloutConfig(device="cuda"),
            ClusterConfig(cpu_ranks_per_node=2),
        )


def test_cpu_ranks_per_node_is_checked_when_the_config_loads(tmp_path):
    cfg = _load(tmp_path, "qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B)
    with pytest.raises(ValueError, match="cluster.cpu_ranks_per_node: 4 applies to CPU runs only"):
        _load(tmp_path, "qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B, "cluster.cpu_ranks_per_node=4")
    with pytest.raises(ValueError, match="cluster.cpu_ranks_per_node"):
        _load(tmp_path, "qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B, "cluster.cpu_ranks_per_node=-1")
    assert cfg.cluster.forward_env and "HF_TOKEN" in cfg.cluster.forward_env


def test_threads_split_each_node_among_its_processes():
    from rlmega.launch import threads

    assert threads.per_process(["a", "a", "b"], {"a": 4, "b": 2}) == [2, 2, 2]
    assert threads.per_process(["a"] * 4, {"a": 2}) == [1] * 4  # never below one
    # fractional Ray CPUs; unknown node: 1
    assert threads.per_process(["a", "b"], {"a": 3.5}) == [3, 1]


def _check_resources(plan):
    """Each bundle covers what the slots in it ask: CPUs on a slot's first bundle, GPUs on each of its bundles
    (the fractional shares on one GPU add up to at most one)."""
    cpus, gpus = Counter(), Counter()
    for s in plan.ranks + plan.engines + plan.critics:
        cpus[s.group, s.bundles[0]] += s.cpus
        for b in s.bundles:
            gpus[s.group, b] += s.gpus
    for (g, b), n in cpus.items():
        assert n <= plan.groups[g][b]["CPU"] + 1e-9, (g, b)
    for (g, b), n in gpus.items():
        assert n <= plan.groups[g][b].get("GPU", 0) + 1e-9 and n <= 1 + 1e-9, (g, b)


_T = 1 / 3
# (world, TP), rollout, cluster, critic_world -> each critic rank's (group, bundle, gpus), bundles per group
CRITIC_CASES = {
    "cpu one group, colocated": (
        (2, 1),
        dict(num_engines=3),
        dict(actor_cpus_per_rank=0.5, engine_cpus=0.25),
        3,
        [(0, 2, 0.0), (0, 3, 0.0), (0, 4, 0.0)],
        [5],
    ),
    "cpu one group, separate": (
        (2, 1),
        dict(num_engines=1),
        dict(colocate=False),
        2,
        [(0, 3, 0.0), (0, 4, 0.0)],
        [5],
    ),
    "cpu per node, groups added": (  # critic rank c on trainer rank c's node; ranks 4-5 on a third node
        (4, 2),
        dict(num_engines=3),
        dict(cpu_ranks_per_node=2),
        6,
        [(0, 2, 0.0), (0, 3, 0.0), (1, 2, 0.0), (1, 3, 0.0), (2, 0, 0.0), (2, 1, 0.0)],
        [4, 4, 2],
    ),
    "cpu per node, separate, smaller": (
        (4, 2),
        dict(num_engines=2),
        dict(cpu_ranks_per_node=2, colocate=False),
        1,
        [(0, 3, 0.0)],
        [4, 3],
    ),
    "gpu colocated, a third each": (
        (16, 4),
        dict(device="cuda", num_engines=8, tensor_parallel_size=2),
        dict(),
        8,
        [(0, c, _T) for c in range(8)],
        [8, 8],
    ),
    "gpu colocated, every trainer gpu": (
        (8, 2),
        dict(device="cuda", num_engines=4, tensor_parallel_size=2),
        dict(),
        8,
        [(0, c, _T) for c in range(8)],
        [8],
    ),
    "gpu separate, between trainer and engines": (  # trainer 8+4, critic 8+2, engines of TP4 two per node
        (12, 4),
        dict(device="cuda", num_engines=3, tensor_parallel_size=4),
        dict(colocate=False),
        10,
        [(2 + c // 8, c % 8, 1.0) for c in range(10)],
        [8, 4, 8, 2, 8, 4],
    ),
}


@pytest.mark.parametrize("case", CRITIC_CASES, ids=list(CRITIC_CASES))
def test_critic_ranks_are_placed_like_the_trainers(case):
    (world, ttp), roll, clu, critic_world, critics, sizes = CRITIC_CASES[case]
    args = (
        ParallelismConfig(tensor_model_parallel_size=ttp, world_size=world),
        RolloutConfig(**roll),
        ClusterConfig(**clu),
    )
    plain, plan = placement_plan(*args), placement_plan(*args, critic_world)
    assert plain.critics == [] and placement_plan(*args, 0) == plain
    assert [(s.group, s.bundles, s.gpus) for s in plan.critics] == [
        (g, (b,), x) for g, b, x in critics
    ]
    assert [len(g) for g in plan.groups] == sizes and plan.strategy == plain.strategy
    assert {s.cpus for s in plan.critics} == {args[2].actor_cpus_per_rank}
    _check_resources(plain)
    _check_resources(plan)
    # The trainer keeps its slots and the engines their bundles; separate GPU engines move past the critic's nodes.
    assert [(s.group, s.bundles) for s in plan.ranks] == [(s.group, s.bundles) for s in plain.ranks]
    shift = (
        len(plan.groups) - len(plain.groups)
        if roll.get("device") == "cuda" and not args[2].colocate
        else 0
    )
    assert [(s.group, s.bundles) for s in plan.engines] == [
        (s.group + shift, s.bundles) for s in plain.engines
    ]
    # trainer, engine worker and critic: a third of a GPU each
    if roll.get("device") == "cuda" and args[2].colocate:
        assert {s.gpus for s in plan.ranks + plan.engines} == {_T} and {
            s.gpus for s in plain.ranks
        } == {0.5}
        load = Counter()
        for s in plan.ranks + plan.engines + plan.critics:
            for g in plan.gpus(s):
                load[g] += s.gpus
        # a critic's GPU holds all three
        assert all(abs(load[g] - 1) < 1e-9 for s in plan.critics for g in plan.gpus(s))
        # critic rank c's CPUs join trainer rank c's bundle
        assert all(
            plan.groups[s.group][s.bundles[0]]["CPU"]
            == plain.groups[s.group][s.bundles[0]]["CPU"] + s.cpus
            for s in plan.critics
        )
    else:
        assert all(
            plan.groups[s.group][s.bundles[0]] == {"CPU": s.cpus, **({"GPU": 1} if s.gpus else {})}
            for s in plan.critics
        )


def test_a_colocated_critic_larger_than_the_trainer_is_refused():
    par, roll = ParallelismConfig(world_size=8), RolloutConfig(device="cuda")
    with pytest.raises(
        PlacementError,
        match=r"critic.parallelism.world_size: 9 colocated critic ranks .* Fix: set "
        r"critic.parallelism.world_size <= 8, or cluster.colocate=false",
    ):
        placement_plan(par, roll, ClusterConfig(), 9)
    assert len(placement_plan(par, roll, ClusterConfig(colocate=False), 9).critics) == 9
