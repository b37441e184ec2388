"""FusedLayers (rlmega/sync/fused_layers.py): which HF tensors fill which vLLM layer, and that a
fused layer goes on only whole, whatever the buckets' boundaries. Names as vLLM's Qwen2 and Qwen3-MoE
report them (the real engines: tests/e2e/test_rollout_worker.py, tests/e2e/test_engine_routes.py)."""

import random

from rlmega.sync.fused_layers import FusedLayers

VLLM = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.qkv_proj.bias",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.experts.routed_experts.w13_weight",
    "model.layers.0.mlp.experts.routed_experts.w2_weight",
    "lm_head.weight",
]
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
EXPERTS = {
    "model.layers.0.mlp.experts.routed_experts": [
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
        for e in range(2)
        for p in ("gate", "up", "down")
    ]
}
HF = (
    ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"]
    + [f"model.layers.0.self_attn.{p}_proj.{x}" for p in "qkv" for x in ("weight", "bias")]
    + [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
    + EXPERTS[next(iter(EXPERTS))]
)


def test_layers_and_their_members():
    layers = FusedLayers(VLLM, PACKED, EXPERTS)
    assert layers.members["model.layers.0.self_attn.qkv_proj"] == {
        f"model.layers.0.self_attn.{p}_proj.{x}" for p in "qkv" for x in ("weight", "bias")
    }
    assert layers.members["model.layers.0.mlp.gate_up_proj"] == {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    assert len(layers.members["model.layers.0.mlp.experts.routed_experts"]) == 6
    assert (
        layers.layer_of("model.layers.0.self_attn.k_proj.bias")
        == "model.layers.0.self_attn.qkv_proj"
    )


def test_any_split_into_buckets_passes_each_layer_on_once_and_whole():
    for seed in range(20):
        layers = FusedLayers(VLLM, PACKED, EXPERTS)
        names = random.Random(seed).sample(HF, len(HF))
        cuts = sorted(random.Random(seed + 100).sample(range(1, len(names)), 3))
        groups = []
        for a, b in zip([0] + cuts, cuts + [len(names)]):
            groups += layers.complete((n, i) for i, n in enumerate(names[a:b]))
        assert layers.pending() == []
        assert sorted(n for g in groups for n, _ in g) == sorted(HF)  # each once
        for g in groups:  # a fused layer whole in one group; plain ones alone
            layer = layers.layer_of(g[0][0])
            assert {n for n, _ in g} == layers.members.get(layer, {g[0][0]}), g


def test_an_incomplete_layer_is_held_and_named():
    layers = FusedLayers(VLLM, PACKED, EXPERTS)
    assert layers.complete([("model.layers.0.self_attn.q_proj.weight", 1)]) == []
    assert layers.pending() == ["model.layers.0.self_attn.q_proj.weight"]
    try:
        layers.check_none_pending()
    except RuntimeError as e:
        assert "1 weights wait for the rest of their fused vLLM layer" in str(e)
    else:
        raise AssertionError("no error")
