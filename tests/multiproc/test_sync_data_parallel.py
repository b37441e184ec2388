"""sync_model_to_rollout at TP2 x DP2 on 4 real gloo ranks: data-parallel replica 0 alone sends.

The engine here records what it receives (the real vLLM engine is tests/e2e/test_sync_to_rollout.py);
what matters is which ranks send or gather, and that the weights arrive exact: with a transport that
takes pieces (each TP rank's blocks, rlmega/sync/pieces.py) nobody gathers and both TP ranks send;
with one that does not (CUDA IPC), the shards go to TP rank 0 alone, which sends whole tensors.
"""

import pytest
import torch
from safetensors.torch import load_file

from rlmega.sync.pieces import Assembled, Assembler, Piece
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=2,
            seed=3,
        )
    )


class RecordingEngine:
    """Keeps a copy of everything it is sent (tensors and pieces), and the versions. Each rank's copy of
    the transport holds its own copy of the engine: the test puts the ranks' pieces together."""

    def __init__(self):
        self.received, self.versions = [], []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        from rlmega.sync.pieces import Piece

        for n, t in named_tensors:
            self.received.append(
                (
                    n,
                    Piece(t.tensor.clone(), t.full_shape, t.dim, t.start, t.of)
                    if isinstance(t, Piece)
                    else t.clone(),
                )
            )
        self.versions.append(version)

    def finish_weights(self, version: int, sender) -> None:
        self.versions.append(version)


def _sync_body(path, pieces):
    import torch.distributed as dist

    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.runtime import data_parallel_rank_and_size, tensor_parallel_rank
    from rlmega.sync.transports import DirectTransport
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=path),
        ParallelismConfig(2, 1, None, 4),
        OptimizerConfig(),
        ActorConfig(),
        AlgorithmConfig(),
    )
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
    transport = DirectTransport([engine])
    transport.takes_pieces = pieces
    for kind in kinds:
        setattr(dist, kind, counting(kind))
    try:
        sent = actor.sync_model_to_rollout(transport, 7, bucket_bytes=64 << 10)
    finally:
        for kind in kinds:
            setattr(dist, kind, real[kind])
    out = {
        "dp": data_parallel_rank_and_size()[0],
        "tp": tensor_parallel_rank(),
        "sent": sent,
        **{kind: calls.count(kind) for kind in kinds},
        "received": engine.received,
        "versions": set(engine.versions),
    }
    actor.teardown()
    return out


@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "gathered"])
def test_only_replica_0_sends_and_the_engine_gets_exact_weights(hf_model, pieces):
    ranks = run_on_ranks(_sync_body, 4, args=(hf_model, pieces), timeout_s=600)
    hf = load_file(f"{hf_model}/model.safetensors")
    by_place = {(r["dp"], r["tp"]): r for r in ranks}
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for tp in (0, 1):
        replica0, replica1 = by_place[(0, tp)], by_place[(1, tp)]
        assert replica0["gather"] == replica0["all_gather"] == 0
        # DP 1 holds the same weights: it must not repeat the TP gathers (nor anything else but the barrier).
        assert (
            replica1["send"]
            == replica1["irecv"]
            == replica1["gather"]
            == replica1["all_gather"]
            == 0
        ), f"DP 1, TP {tp} gathered: {replica1}"
        assert (
            replica1["sent"]["gathered"] == 0
            and replica1["sent"]["tensors"] == 0
            and not replica1["received"]
        )
    tp0, tp1 = by_place[(0, 0)], by_place[(0, 1)]
    assembler, got = Assembler(), {}
    # as the engine's RolloutWorker does
    for name, value in assembler.add(tp0["received"] + tp1["received"], 7):
        assert name not in got  # each tensor arrives (or completes) once
        got[name] = value.tensor() if isinstance(value, Assembled) else value
    assert assembler.pending() == []
    n_pieces = [sum(isinstance(t, Piece) for _, t in r["received"]) for r in (tp0, tp1)]
    if pieces:  # nobody gathers; each TP rank sends its blocks (TP 0 the replicated tensors too)
        assert tp0["send"] == tp0["irecv"] == tp1["send"] == tp1["irecv"] == 0
        assert (
            n_pieces[0] == n_pieces[1] == tp1["sent"]["tensors"] > 0
            and tp0["sent"]["tensors"] > n_pieces[0]
        )
        assert tp0["sent"]["bytes"] + tp1["sent"]["bytes"] == sum(t.nbytes for t in hf.values())
    else:  # to the sender only: TP 1 sends each TP-split parameter's shard, TP 0 receives them
        shards = tp1["send"]
        assert shards > 0 and tp0["irecv"] == shards and tp0["send"] == tp1["irecv"] == 0
        # TP 1 builds no full tensor; TP 0 builds every one and sends them whole.
        assert (
            tp1["sent"]["gathered"] == tp1["sent"]["tensors"] == 0
            and not tp1["received"]
            and n_pieces[0] == 0
        )
        assert (
            tp0["sent"]["gathered"] == tp0["sent"]["tensors"] == len(hf)
            and tp0["sent"]["buckets"] > 1
        )
    assert tp0["versions"] == {7}
    assert sorted(got) == sorted(hf)
    for name, value in hf.items():
        assert torch.equal(got[name], value), name
