"""Several nodes, simulated on this machine: a Ray cluster (ray.cluster_utils.Cluster) of a head with no
CPUs and three worker nodes of 2 CPUs and 4 (logical, fake) GPUs each.

Checks, through the code Roles runs (rlmega.launch.cluster, WorkerGroup, engines.engine_options):
each Megatron TP group of trainer ranks and each vLLM TP engine lands on one node, groups on distinct
nodes, engines round robin over them; workers get rlmega through the runtime_env and their output
reaches the driver; a node that does not see the run dir is named; the tiny run trains across nodes.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from conftest import ROOT
from ray.cluster_utils import Cluster

from rlmega.config.placement_plan import placement_plan
from rlmega.config.schema import ClusterConfig, ParallelismConfig, RolloutConfig
from rlmega.launch.cluster import ClusterError, check_shared_paths, place_groups
from rlmega.launch.engines import engine_options as _engine_options
from rlmega.launch.worker_group import WorkerGroup

RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        c.add_node(num_cpus=2, num_gpus=4)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


class Probe:
    """Stands in for a trainer rank or an engine: says where it runs (pickled by value below: workers
    cannot import this test module)."""

    def where(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": ray.get_gpu_ids(),
            "local_rank": os.environ.get("LOCAL_RANK"),
        }


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_tp_groups_and_engines_land_where_the_plan_puts_them(cluster):
    # 8 ranks of Megatron TP2 on nodes of 4 GPUs, 4 colocated engines of vLLM TP2 (the qwen2 2-node layout, halved)
    plan = placement_plan(
        ParallelismConfig(tensor_model_parallel_size=2, world_size=8),
        RolloutConfig(device="cuda", num_engines=4, tensor_parallel_size=2),
        ClusterConfig(gpus_per_node=4, actor_cpus_per_rank=0.1, engine_cpus=0.1),
    )
    pgs, nodes = place_groups(plan, timeout_s=60)
    group, engines = None, []
    try:
        # a group is one node, not shared
        assert all(len(set(g)) == 1 for g in nodes) and nodes[0][0] != nodes[1][0]
        group = WorkerGroup(
            Probe,
            8,
            num_cpus=0.1,
            num_gpus=plan.ranks[0].gpus,
            placement_group=[(pgs[s.group], s.bundles[0]) for s in plan.ranks],
            timeout_s=120,
        )
        ranks = group.call("where")
        Engine = ray.remote(Probe)
        engines = [
            Engine.options(**_engine_options(pgs[s.group], s)).remote() for s in plan.engines
        ]
        placed = ray.get([e.where.remote() for e in engines], timeout=120)
    finally:
        for e in engines:
            ray.kill(e)
        if group is not None:
            group.shutdown()
        for pg in pgs:
            ray.util.remove_placement_group(pg)
    node_a, node_b = nodes[0][0], nodes[1][0]
    # rank order fills a node, then the next
    assert [r["node"] for r in ranks] == [node_a] * 4 + [node_b] * 4
    assert group.node_ids == [r["node"] for r in ranks]
    for tp_group in ([0, 1], [2, 3], [4, 5], [6, 7]):  # Megatron's TP groups: consecutive ranks
        assert len({ranks[r]["node"] for r in tp_group}) == 1
    assert [r["local_rank"] for r in ranks] == ["0", "1", "2", "3"] * 2
    assert all(len(set(map(str, r["gpus"]))) == 1 for r in ranks)  # half of one GPU each
    # engines alternate nodes
    assert [p["node"] for p in placed] == [node_a, node_b, node_a, node_b]
    for slot, p in zip(plan.engines, placed):  # every TP worker's bundle is on the engine's node
        assert {nodes[slot.group][b] for b in slot.bundles} == {p["node"]}
    # more node groups than nodes: said at once, not after the placement timeout
    big = placement_plan(
        ParallelismConfig(world_size=20),
        RolloutConfig(device="cuda"),
        ClusterConfig(gpus_per_node=4),
    )
    with pytest.raises(ClusterError, match="needs 5 nodes .* the cluster has 4"):
        place_groups(big, timeout_s=60)


def test_workers_import_the_drivers_rlmega_get_its_env_and_their_output_reaches_it(
    cluster, tmp_path
):
    # A driver attached the way `rlmega train cluster.address=...` attaches; a task on a worker node
    # reports where it imported rlmega from and prints a line to stdout and one to stderr. The nodes'
    # own PYTHONPATH (inherited from this process) holds the checkout: the uploaded copy must win. The
    # driver runs from a folder without rlmega, as Ray puts its cwd first on the workers' sys.path.
    script = r"""
import json, sys, time, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rlmega.config.schema import ClusterConfig
from rlmega.launch.cluster import connect
assert connect(ClusterConfig(address=sys.argv[1], forward_env=["RLMEGA_PROBE", "RLMEGA_UNSET"]), 0) is False

@ray.remote(num_cpus=0)
def where():
    import os, rlmega
    print("stdout line from a worker node", flush=True)
    print("stderr line from a worker node", file=sys.stderr, flush=True)
    return {"rlmega": rlmega.__file__, "probe": os.environ.get("RLMEGA_PROBE"), "unset": "RLMEGA_UNSET" in os.environ}

node = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("CPU"))
print(json.dumps(ray.get(where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())))
time.sleep(2)  # Ray's log monitor forwards worker output about once a second
"""
    env = {**os.environ, "RLMEGA_PROBE": "from-the-driver", "PYTHONPATH": str(ROOT)}
    env.pop("RLMEGA_UNSET", None)
    out = subprocess.run(
        [sys.executable, "-c", script, cluster.address],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    # the uploaded copy, ahead of the checkout the raylets' own PYTHONPATH points at
    assert "/runtime_resources/py_modules_files/" in got["rlmega"] and not got["rlmega"].startswith(
        str(ROOT)
    ), got
    assert got["probe"] == "from-the-driver" and not got["unset"]
    assert "stdout line from a worker node" in out.stdout
    assert "stderr line from a worker node" in out.stderr


def _can_hide(folder: Path) -> bool:
    """Whether this process may mount a tmpfs over ``folder`` in a mount namespace of its own (root with
    CAP_SYS_ADMIN; an unprivileged container says no)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return (
        subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {folder}"], capture_output=True
        ).returncode
        == 0
    )


def test_a_node_that_does_not_see_the_run_dir_is_named(cluster, tmp_path):
    # A worker node whose processes have a private mount namespace with an empty tmpfs over `shared`:
    # the node runs, but the run dir and model under it are not the driver's.
    shared = tmp_path / "shared"
    shared.mkdir()
    if not _can_hide(shared):
        pytest.skip("needs root with CAP_SYS_ADMIN for unshare -m and mount -t tmpfs")
    run_dir, model = shared / "run", shared / "model"
    run_dir.mkdir(parents=True)
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    node = subprocess.Popen(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount -t tmpfs none {shared} && exec {RAY} start "
            f"--address={cluster.address} --num-cpus=1 --block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (hidden := {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before):
            assert node.poll() is None and time.monotonic() < deadline, (
                "the hidden node did not join"
            )
            time.sleep(0.5)
        hidden = hidden.pop()
        seeing = sorted(before - {ray.get_runtime_context().get_node_id()})
        # the nodes that share the folder pass
        check_shared_paths(str(run_dir), str(model), seeing, [])
        with pytest.raises(ClusterError) as e:
            check_shared_paths(str(run_dir), str(model), [seeing[0], hidden], [])
        message = str(e.value)
        assert message.count(hidden[:8]) == 2 and seeing[0][:8] not in message, message
        assert "trainer.run_dir" in message and "on a filesystem every node mounts" in message
        assert "model.path" in message
        with pytest.raises(ClusterError, match=f"model.path: .* on node\\(s\\) {hidden[:8]}") as e:
            # an engine's node needs only the model
            check_shared_paths(str(run_dir), str(model), [seeing[0]], [hidden])
        assert "trainer.run_dir" not in str(e.value)
        assert not list(run_dir.iterdir())  # the token file is removed
    finally:
        node.terminate()
        node.wait(timeout=60)


@pytest.mark.slow
def test_the_tiny_run_trains_across_nodes(cluster, tiny_model, tmp_path):
    """With rollout.weight_transport=collective: the weights of the trainer ranks on the engine's node
    and on the other node reach it by gloo broadcast (rlmega/sync/collective.py), and the engine then
    samples from the trainer's weights (the step's parity)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlmega.train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={tiny_model}",
        f"trainer.run_dir={run}",
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.warmup_sft_steps=2",
        "rollout.max_response_tokens=8",
        "data.synthetic_size=100",
        "logging.tensorboard=false",
        f"cluster.address={cluster.address}",
        "cluster.cpu_ranks_per_node=2",
        "rollout.weight_transport=collective",
    ]
    start = time.monotonic()
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    print(f"tiny run across nodes: {time.monotonic() - start:.0f} s")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    print("parity_max per step", [m.get("parity_max") for m in metrics])
    # float32: ~1e-6 when the sync is right
    assert all(m["parity_max"] < 1e-4 for m in metrics), metrics
    # "placement: trainer ranks on nodes A (ip): 0 1, B (ip): 2 3; rollout engines on nodes A (ip): 0"
    line = re.search(
        r"placement: trainer ranks on nodes (.*); rollout engines on nodes (.*)", out.stderr
    )
    assert line, out.stderr[-3000:]
    ranks = dict(re.findall(r"(\w{8}) \([^)]*\): ([\d ]+)", line.group(1)))
    # each TP2 group on a node of its own
    assert sorted(ranks.values()) == ["0 1", "2 3"], line.group(0)
    workers = {n["NodeID"][:8] for n in ray.nodes() if n["Resources"].get("CPU")}
    assert set(ranks) <= workers and len(ranks) == 2
    # worker output forwarded
    assert re.search(r"\((_RankHost|RolloutWorker)[^)]*pid=\d+", out.stdout + out.stderr)
