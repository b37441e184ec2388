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
    # Count this rank's TP collectives during the sync only: hf_io gathers a sync's shards to the
    # sender (the others dist.send, it dist.irecv's), all-gathering only what every rank needs
    # (experts under EP > 1: none here).
    kinds = ("all_gather", "gather", "send", "irecv")
    calls, real = [], {kind: getattr(dist, kind) for kind in kinds}

    def counting(kind):
        def call(*args, **kwargs):
            calls.append(kind)
            return real[kind](*args, **kwargs)
        return call

    engine = RecordingEngine()
    for kind in kinds:
        setattr(dist, kind, counting(kind))
    try:
        sent = actor.sync_model_to_rollout(DirectTransport([engine]), 7, bucket_bytes=64 << 10)
    finally:
        for kind in kinds:
            setattr(dist, kind, real[kind])
    out = {"dp": data_parallel_rank_and_size()[0], "tp": tensor_parallel_rank(), "sent": sent,
           **{kind: calls.count(kind) for kind in kinds}, "received": engine.tensors, "versions": set(engine.versions)}
    actor.teardown()
    return out


def test_only_replica_0_gathers_and_the_engine_gets_exact_weights(hf_model):
    ranks = run_on_ranks(_sync_body, 4, args=(hf_model,), timeout_s=600)
    hf = load_file(f"{hf_model}/model.safetensors")
    by_place = {(r["dp"], r["tp"]): r for r in ranks}
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # to the sender only: TP 1 sends each TP-split parameter's shard, TP 0 receives them; nothing else
    shards = by_place[(0, 1)]["send"]
    assert shards > 0 and by_place[(0, 0)]["irecv"] == shards and by_place[(0, 0)]["send"] == by_place[(0, 1)]["irecv"] == 0
    for tp in (0, 1):
        replica0, replica1 = by_place[(0, tp)], by_place[(1, tp)]
        assert replica0["gather"] == replica0["all_gather"] == 0
        # DP 1 holds the same weights: it must not repeat the TP gathers (nor anything else but the barrier).
        assert replica1["send"] == replica1["irecv"] == replica1["gather"] == replica1["all_gather"] == 0, \
            f"DP 1, TP {tp} gathered: {replica1}"
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
