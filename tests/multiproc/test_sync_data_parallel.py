"""sync_model_to_rollout at TP2 x DP2 on 4 real gloo ranks: data-parallel replica 0 alone gathers.

The engine here records what it receives (the real vLLM engine is tests/e2e/test_sync_to_rollout.py);
what matters is which ranks run the TP gathers (to the sender only) and that the weights arrive exact.
"""
import pytest
import torch
from safetensors.torch import load_file

from rlmega.testing.multiproc import run_on_ranks
from rlmega.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", hidden_size=128, num_heads=2,
                               num_kv_heads=2, num_layers=2, seed=3))


class RecordingEngine:
    """Keeps a copy of every tensor it is sent, and the versions."""

    def __init__(self):
        self.tensors, self.versions = {}, []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        self.tensors.update((n, t.clone()) for n, t in named_tensors)
        self.versions.append(version)

    def finish_weights(self, version: int, sender) -> None:
        self.versions.append(version)


def _sync_body(path):
    import torch.distributed as dist

    from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.runtime import data_parallel_rank_and_size, tensor_parallel_rank
    from rlmega.sync.transports import DirectTransport
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(ModelConfig(path=path), ParallelismConfig(2, 1, None, 4), OptimizerConfig(),
                          ActorConfig(), AlgorithmConfig())
    actor.setup(with_reference=False)
    # Count this rank's TP gathers during the sync only: hf_io gathers a sync's shards to the sender
    # (dist.gather), all-gathering only what every rank needs (experts under EP > 1: none here).
    calls, real = [], {"all_gather": dist.all_gather, "gather": dist.gather}

    def counting(kind):
        def call(*args, **kwargs):
            calls.append(kind)
            return real[kind](*args, **kwargs)
        return call

    engine = RecordingEngine()
    dist.all_gather, dist.gather = counting("all_gather"), counting("gather")
    try:
        sent = actor.sync_model_to_rollout(DirectTransport([engine]), 7, bucket_bytes=64 << 10)
    finally:
        dist.all_gather, dist.gather = real["all_gather"], real["gather"]
    out = {"dp": data_parallel_rank_and_size()[0], "tp": tensor_parallel_rank(), "gathers": calls.count("gather"),
           "all_gathers": calls.count("all_gather"), "sent": sent, "received": engine.tensors,
           "versions": set(engine.versions)}
    actor.teardown()
    return out


def test_only_replica_0_gathers_and_the_engine_gets_exact_weights(hf_model):
    ranks = run_on_ranks(_sync_body, 4, args=(hf_model,), timeout_s=600)
    hf = load_file(f"{hf_model}/model.safetensors")
    by_place = {(r["dp"], r["tp"]): r for r in ranks}
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for tp in (0, 1):
        replica0, replica1 = by_place[(0, tp)], by_place[(1, tp)]
        assert replica0["gathers"] > 0 and replica0["all_gathers"] == 0  # to the sender only
        # DP 1 holds the same weights: it must not repeat the TP gathers (nor anything else but the barrier).
        assert replica1["gathers"] == replica1["all_gathers"] == 0, f"DP 1, TP {tp} gathered: {replica1}"
        assert replica1["sent"]["gathered"] == 0 and replica1["sent"]["tensors"] == 0 and not replica1["received"]
    # TP 1 sends its shards to TP 0 and builds no full tensor; TP 0 builds every one and sends them.
    assert by_place[(0, 1)]["sent"]["gathered"] == by_place[(0, 1)]["sent"]["tensors"] == 0
    assert not by_place[(0, 1)]["received"] and by_place[(0, 0)]["sent"]["gathered"] == len(hf)
    sender = by_place[(0, 0)]
    got = sender["received"]
    assert sender["sent"]["tensors"] == len(hf) and sender["versions"] == {7} and sender["sent"]["buckets"] > 1
    assert sorted(got) == sorted(hf)
    for name, value in hf.items():
        assert torch.equal(got[name], value), name
