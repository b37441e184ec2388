"""WorkerGroup (launch/worker_group.py) on a real local Ray: ``call`` returns every rank's answer in rank
order; ``call_rank0`` runs on every rank but brings back rank 0's answer only, and still names a rank
that raises."""

import importlib.util

import pytest
import ray

from rlmega.launch.worker_group import WorkerGroup, WorkerGroupError
from rlmega.testing.torchrun_probe import Probe


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_call_rank0_runs_everywhere_and_returns_rank_0s_answer(local_ray):
    group = WorkerGroup(Probe, 3, args=("w",), num_cpus=0.1)
    try:
        assert group.call("whoami", 7) == [("w", 0, 70), ("w", 1, 70), ("w", 2, 70)]
        assert group.call_rank0("whoami", 8) == ("w", 0, 80)
        assert group.call("count") == [2, 2, 2]  # the other ranks ran it too
        with pytest.raises(
            WorkerGroupError, match="trainer rank 1 raised ValueError: rank 1 fails on purpose"
        ):
            group.call_rank0("fail", 1)
    finally:
        group.shutdown()


def test_ranks_on_one_node_meet_on_loopback_and_keep_wandb_out(local_ray):
    # rank 0's store listens on MASTER_ADDR only (tests/multiproc/test_store_binding.py): here, loopback
    group = WorkerGroup(Probe, 2, args=("w",), num_cpus=0.1)
    try:
        assert group.call("env", "MASTER_ADDR") == ["127.0.0.1", "127.0.0.1"]
        # installed here (the dev extra), yet a rank cannot import it, so megatron-core does not (0.8 s a rank:
        # launch/rank_imports.py)
        assert importlib.util.find_spec("wandb") is not None
        assert group.call("importable", "wandb") == [False, False]
    finally:
        group.shutdown()


def test_roles_thread_split_and_its_overrides():
    # what Roles gives each rank and engine (launch/threads.plan), from the nodes' CPUs as Ray reports them
    from rlmega.config.schema import RLConfig
    from rlmega.launch import threads

    cfg, cpus = RLConfig(), {"n": 2}
    assert threads.plan(
        cfg, ["n", "n"], ["n"], cpus, on_torchrun=False, engines_awake_while_training=False
    ) == (1, [2])
    # async: ranks and engines compute at once, so all three processes share the node's CPUs
    assert threads.plan(cfg, ["n"], ["n"], {"n": 4}, False, engines_awake_while_training=True) == (
        2,
        [2],
    )
    cfg.cluster.threads_per_rank, cfg.cluster.threads_per_engine = 3, 5
    assert threads.plan(cfg, ["n", "n"], ["n"], cpus, False, False) == (3, [5])
    cfg.rollout.tensor_parallel_size = 2  # vLLM's own worker processes: left alone
    assert threads.plan(cfg, ["n"], ["n"], cpus, False, False) == (3, [None])
