"""HF <-> Megatron weight layouts (hf_weights) and HF config -> Megatron config (hf_config).

Pure: random tensors for one layer plus embeddings, head and final norm go HF -> Megatron TP
shards -> HF and must come back bit for bit; the fused QKV and gate/up layouts are also written
out by hand on cases small enough to read.
"""

import re

import pytest
import torch

from rlmega.megatron.hf_config import (
    ModelShape,
    UnsupportedModelError,
    check_expert_layout,
    megatron_config_from_hf,
    padded_vocab_size,
)
from rlmega.megatron.hf_weights import from_megatron_shards, rule, to_megatron_shard

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 128, 8, 2, 16, 96, 130


def hf_config(arch: str = "qwen2", **over) -> dict:
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


def random_hf_tensors(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every HF tensor of a one-layer model, random (norms too, so nothing is trivially 1)."""
    g = torch.Generator().manual_seed(seed)
    h, q_rows, kv_rows = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    p = "model.layers.0."
    sizes = {
        "model.embed_tokens.weight": (shape.vocab_size, h),
        "model.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_rows, h),
        p + "self_attn.k_proj.weight": (kv_rows, h),
        p + "self_attn.v_proj.weight": (kv_rows, h),
        p + "self_attn.o_proj.weight": (h, q_rows),
        p + "mlp.gate_proj.weight": (shape.ffn_hidden_size, h),
        p + "mlp.up_proj.weight": (shape.ffn_hidden_size, h),
        p + "mlp.down_proj.weight": (h, shape.ffn_hidden_size),
    }
    if not shape.tie_word_embeddings:
        sizes["lm_head.weight"] = (shape.vocab_size, h)
    if shape.qkv_bias:
        sizes.update(
            {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
        )
    return {k: torch.randn(s, generator=g) for k, s in sizes.items()}


def megatron_names(shape: ModelShape, te: bool = False) -> list[str]:
    """Global Megatron parameter names of a one-layer GPTModel (local spec, or TE's fused norms)."""
    p = "decoder.layers.0."
    names = [
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        p + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
        p + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"),
        p + "self_attention.linear_qkv.weight",
        p + "self_attention.linear_proj.weight",
        p + "mlp.linear_fc1.weight",
        p + "mlp.linear_fc2.weight",
    ]
    if shape.qkv_bias:
        names.append(p + "self_attention.linear_qkv.bias")
    return names


def expected_shard_shape(name: str, shape: ModelShape, tp: int) -> tuple[int, ...]:
    h, d = shape.hidden_size, shape.head_dim
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * d
    table = {
        "self_attention.linear_qkv.weight": (qkv_rows // tp, h),
        "self_attention.linear_qkv.bias": (qkv_rows // tp,),
        "self_attention.linear_proj.weight": (h, shape.num_heads * d // tp),
        "mlp.linear_fc1.weight": (2 * shape.ffn_hidden_size // tp, h),
        "mlp.linear_fc2.weight": (h, shape.ffn_hidden_size // tp),
        "embedding.word_embeddings.weight": (shape.padded_vocab_size // tp, h),
        "output_layer.weight": (shape.padded_vocab_size // tp, h),
    }
    return next((s for suffix, s in table.items() if name.endswith(suffix)), (h,))


def round_trip(hf: dict, shape: ModelShape, tp: int, names: list[str]):
    """(HF tensors rebuilt from the TP shards, {megatron name: [shard per TP rank]})."""
    shards, back = {}, {}
    for name in names:
        shards[name] = [to_megatron_shard(name, hf.__getitem__, shape, r, tp) for r in range(tp)]
        back.update(from_megatron_shards(name, shards[name], shape))
    return back, shards


# ---- hf_weights: round trips ----------------------------------------------------------------


@pytest.mark.parametrize("te", [False, True], ids=["local_spec", "te_spec"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_identical(arch, tp, tied, te):
    shape = ModelShape.from_hf(hf_config(arch, tie_word_embeddings=tied), tp)
    assert shape.padded_vocab_size == 256 and shape.qkv_bias == (arch == "qwen2")
    hf = random_hf_tensors(shape, seed=tp)
    back, shards = round_trip(hf, shape, tp, megatron_names(shape, te))

    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    for name, per_rank in shards.items():
        for r, s in enumerate(per_rank):
            assert tuple(s.shape) == expected_shard_shape(name, shape, tp), (name, r, s.shape)

    # Vocabulary: padded with zero rows to 256 on the Megatron side, trimmed to 130 on export.
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = torch.cat(shards[name], dim=0)
        assert full.shape == (256, HIDDEN)
        assert torch.equal(full[VOCAB:], torch.zeros(256 - VOCAB, HIDDEN))
        ((hf_name, exported),) = from_megatron_shards(name, shards[name], shape).items()
        assert exported.shape == (VOCAB, HIDDEN)
    # Tied: the head is the embedding, in both directions.
    head_source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert rule("output_layer.weight", shape)[1] == [head_source]
    assert torch.equal(torch.cat(shards["output_layer.weight"])[:VOCAB], hf[head_source])
    assert list(
        from_megatron_shards("output_layer.weight", shards["output_layer.weight"], shape)
    ) == [head_source]


def test_layer_index_is_kept_and_norms_are_replicated():
    shape = ModelShape.from_hf(hf_config("llama", num_hidden_layers=12), 2)
    kind, names = rule("decoder.layers.11.mlp.linear_fc2.weight", shape)
    assert kind == "split_dim1" and names == ["model.layers.11.mlp.down_proj.weight"]
    norm = torch.randn(HIDDEN)
    for r in range(2):
        assert (
            to_megatron_shard(
                "decoder.layers.3.input_layernorm.weight", lambda n: norm, shape, r, 2
            )
            is norm
        )
    # TE's fused-norm names and the local spec's names map to the same HF norm.
    assert (
        rule("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", shape)[1]
        == rule("decoder.layers.3.input_layernorm.weight", shape)[1]
        == ["model.layers.3.input_layernorm.weight"]
    )
    assert (
        rule("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", shape)[1]
        == rule("decoder.layers.3.pre_mlp_layernorm.weight", shape)[1]
        == ["model.layers.3.post_attention_layernorm.weight"]
    )


# ---- hf_weights: layouts by hand ------------------------------------------------------------


def test_fused_qkv_layout_by_hand():
    """2 KV groups, 2 query heads per group, head_dim 1: per group [q, q, k, v]."""
    shape = ModelShape.from_hf(
        hf_config("qwen2", hidden_size=3, num_attention_heads=4, num_key_value_heads=2, head_dim=1),
        1,
    )
    q = torch.tensor([10.0, 11.0, 12.0, 13.0])  # q heads 0..3: heads 0,1 -> group 0; 2,3 -> group 1
    k = torch.tensor([20.0, 21.0])
    v = torch.tensor([30.0, 31.0])
    hf = {
        "model.layers.0.self_attn.q_proj.bias": q,
        "model.layers.0.self_attn.k_proj.bias": k,
        "model.layers.0.self_attn.v_proj.bias": v,
    }
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    expected = torch.tensor(
        [
            10.0,
            11.0,
            20.0,
            30.0,  # group 0: q0 q1 k0 v0
            12.0,
            13.0,
            21.0,
            31.0,
        ]
    )  # group 1: q2 q3 k1 v1
    assert torch.equal(to_megatron_shard(name, hf.__getitem__, shape, 0, 1), expected)
    # TP2 hands each rank one whole group.
    assert torch.equal(to_megatron_shard(name, hf.__getitem__, shape, 0, 2), expected[:4])
    assert torch.equal(to_megatron_shard(name, hf.__getitem__, shape, 1, 2), expected[4:])

    # The weight: the same row order, each row carrying its hidden-size columns.
    wq, wk, wv = (t[:, None] * torch.ones(1, 3) + torch.arange(3) / 10 for t in (q, k, v))
    hf_w = {
        "model.layers.0.self_attn.q_proj.weight": wq,
        "model.layers.0.self_attn.k_proj.weight": wk,
        "model.layers.0.self_attn.v_proj.weight": wv,
    }
    fused = to_megatron_shard(
        "decoder.layers.0.self_attention.linear_qkv.weight", hf_w.__getitem__, shape, 0, 1
    )
    rows = [wq[0], wq[1], wk[0], wv[0], wq[2], wq[3], wk[1], wv[1]]
    assert torch.equal(fused, torch.stack(rows))
    back = from_megatron_shards(
        "decoder.layers.0.self_attention.linear_qkv.weight", [fused[:4], fused[4:]], shape
    )
    assert all(torch.equal(back[k], hf_w[k]) for k in hf_w)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_on_tp_rank_r_is_gate_r_then_up_r(tp):
    shape = ModelShape.from_hf(hf_config("llama", intermediate_size=8), tp)
    gate = torch.arange(8.0)[:, None].expand(8, 2).clone()  # row i holds i
    up = 100 + gate
    hf = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up}
    rows = 8 // tp
    for r in range(tp):
        shard = to_megatron_shard(
            "decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__, shape, r, tp
        )
        expected = torch.cat([gate[r * rows : (r + 1) * rows], up[r * rows : (r + 1) * rows]])
        assert torch.equal(shard, expected), (r, shard[:, 0])
    if tp == 2:  # spelled out once
        shard1 = to_megatron_shard(
            "decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__, shape, 1, 2
        )
        assert shard1[:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]


# ---- hf_weights: errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.2.self_attention.q_layernorm.weight",
        "embedding.position_embeddings.weight",
        "nonsense",
    ],
)
def test_rule_for_an_unknown_name_raises_naming_it(name):
    shape = ModelShape.from_hf(hf_config("qwen2"), 1)
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        rule(name, shape)


def test_llama_has_no_qkv_bias():
    shape = ModelShape.from_hf(hf_config("llama"), 1)
    with pytest.raises(KeyError, match="LlamaForCausalLM has no QKV bias"):
        rule("decoder.layers.0.self_attention.linear_qkv.bias", shape)
    with pytest.raises(KeyError):
        to_megatron_shard(
            "decoder.layers.0.self_attention.linear_qkv.bias", lambda n: torch.zeros(1), shape, 0, 1
        )


# ---- hf_config -------------------------------------------------------------------------------


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelShape.from_hf(hf_config(architectures=["MistralForCausalLM"]))
    assert "MistralForCausalLM" in str(e.value)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)
    assert issubclass(UnsupportedModelError, ValueError)


@pytest.mark.parametrize(
    "arch, over, match",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen2", {"hidden_act": "relu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_features_raise(arch, over, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelShape.from_hf(hf_config(arch, **over))


def test_supported_defaults_do_not_raise():
    ModelShape.from_hf(hf_config("llama", attention_bias=False, mlp_bias=False))
    ModelShape.from_hf(hf_config("qwen2", use_sliding_window=False))


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ],
)
def test_non_llama3_rope_scaling_raises(scaling):
    with pytest.raises(UnsupportedModelError, match="llama3"):
        megatron_config_from_hf(hf_config("llama", **scaling))


@pytest.mark.parametrize(
    "vocab, tp, padded",
    [
        (59, 1, 128),
        (59, 2, 128),
        (59, 4, 128),
        (59, 3, 384),
        (128, 1, 128),
        (129, 2, 256),
        (130, 8, 256),
    ],
)
def test_padded_vocab_size(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded
    assert padded % tp == 0 and padded >= vocab


def test_model_shape_fields():
    s = ModelShape.from_hf(
        hf_config("qwen2", num_hidden_layers=4, vocab_size=59, tie_word_embeddings=True), tp=2
    )
    assert (
        s.architecture,
        s.num_layers,
        s.hidden_size,
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
    ) == ("Qwen2ForCausalLM", 4, HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert (
        s.ffn_hidden_size,
        s.vocab_size,
        s.padded_vocab_size,
        s.tie_word_embeddings,
        s.qkv_bias,
    ) == (FFN, 59, 128, True, True)
    # No head_dim / num_key_value_heads: derived as transformers does (MHA, hidden / heads).
    derived = hf_config("llama")
    del derived["head_dim"], derived["num_key_value_heads"]
    s = ModelShape.from_hf(derived)
    assert (s.head_dim, s.num_kv_heads, s.qkv_bias) == (HIDDEN // HEADS, HEADS, False)


def test_megatron_config_from_hf_maps_the_hyper_parameters():
    cfg, kw = megatron_config_from_hf(
        hf_config(
            "qwen2",
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-5,
            num_hidden_layers=4,
            max_position_embeddings=2048,
        ),
        tp=2,
        pp=2,
    )
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (
        4,
        HIDDEN,
        HEADS,
        KV_HEADS,
    )
    assert cfg.ffn_hidden_size == FFN and cfg.kv_channels == HEAD_DIM
    assert (
        cfg.layernorm_epsilon == 1e-5 and cfg.normalization == "RMSNorm" and cfg.gated_linear_unit
    )
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.virtual_pipeline_model_parallel_size is None
    assert (
        kw["rotary_base"] == 1_000_000
        and kw["vocab_size"] == 256
        and kw["max_sequence_length"] == 2048
    )
    assert kw["rope_scaling"] is False and kw["share_embeddings_and_output_weights"] is False

    cfg, kw = megatron_config_from_hf(hf_config("llama", tie_word_embeddings=True), pp=2, vpp=2)
    assert not cfg.add_qkv_bias and kw["share_embeddings_and_output_weights"] is True
    assert cfg.virtual_pipeline_model_parallel_size == 2


def test_kv_channels_is_the_explicit_head_dim():
    # head_dim 64 with hidden 128 / 8 heads (= 16): Megatron must use the config's value.
    cfg, _ = megatron_config_from_hf(hf_config("llama", head_dim=64))
    assert cfg.kv_channels == 64
    derived = hf_config("llama")
    del derived["head_dim"]
    cfg, _ = megatron_config_from_hf(derived)
    assert cfg.kv_channels == HIDDEN // HEADS


def test_rope_theta_from_transformers5_rope_parameters():
    cfg = hf_config("llama")
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    _, kw = megatron_config_from_hf(cfg)
    assert kw["rotary_base"] == 500000 and kw["rope_scaling"] is False
    # Non-integer theta stays a float.
    _, kw = megatron_config_from_hf(hf_config("llama", rope_theta=12345.5))
    assert kw["rotary_base"] == 12345.5


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling(style):
    llama3 = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = hf_config("llama", rope_theta=500000.0)
    if style == "rope_scaling":
        cfg["rope_scaling"] = llama3
    else:
        del cfg["rope_theta"]
        cfg["rope_parameters"] = {**llama3, "rope_theta": 500000.0}
    _, kw = megatron_config_from_hf(cfg)
    assert (
        kw["rope_scaling"] is True
        and kw["rope_scaling_factor"] == 32.0
        and kw["rotary_base"] == 500000
    )


# ---- Qwen3 (q/k norms), Qwen3-MoE and Mixtral (experts, router) ------------------------------------------


def qwen3_moe_config(**over) -> dict:
    cfg = hf_config(
        "llama",
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    cfg.update(over)
    return cfg


def test_qwen3_has_qk_norms_and_no_qkv_bias():
    cfg = hf_config("llama", architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    shape = ModelShape.from_hf(cfg)
    assert shape.qk_norm and not shape.qkv_bias and not shape.is_moe
    tcfg, _ = megatron_config_from_hf(cfg)
    assert tcfg.qk_layernorm and not tcfg.add_qkv_bias and tcfg.num_moe_experts is None
    assert rule("decoder.layers.3.self_attention.q_layernorm.weight", shape) == (
        "replicated",
        ["model.layers.3.self_attn.q_norm.weight"],
    )
    assert rule("decoder.layers.3.self_attention.k_layernorm.weight", shape)[1] == [
        "model.layers.3.self_attn.k_norm.weight"
    ]
    # model_type alone names the class too
    del cfg["architectures"]
    assert ModelShape.from_hf(cfg).architecture == "Qwen3ForCausalLM"


# transformers 5 writes the first, Qwen the second
@pytest.mark.parametrize("key", ["num_local_experts", "num_experts"])
def test_qwen3_moe_shape_and_router_mapping(key):
    cfg = qwen3_moe_config()
    cfg[key] = cfg.pop("num_local_experts")
    shape = ModelShape.from_hf(cfg)
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size, shape.norm_topk_prob) == (
        4,
        2,
        32,
        True,
    )
    tcfg, _ = megatron_config_from_hf(cfg)
    assert (
        tcfg.num_moe_experts == 4 and tcfg.moe_router_topk == 2 and tcfg.moe_ffn_hidden_size == 32
    )
    # norm_topk_prob <-> softmax over the top-k logits (pre_softmax False); parity test checks it numerically
    assert tcfg.moe_router_score_function == "softmax" and tcfg.moe_router_pre_softmax is False
    # aux loss 0: no load-balancing term at all; z-loss off; routing replay off
    assert tcfg.moe_router_load_balancing_type == "none" and tcfg.moe_z_loss_coeff is None
    assert not tcfg.moe_enable_routing_replay and tcfg.moe_shared_expert_intermediate_size is None
    tcfg, _ = megatron_config_from_hf(
        qwen3_moe_config(norm_topk_prob=False),
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        routing_replay=True,
    )
    assert tcfg.moe_router_pre_softmax is True and tcfg.moe_router_load_balancing_type == "aux_loss"
    assert (
        tcfg.moe_aux_loss_coeff == 0.01
        and tcfg.moe_z_loss_coeff == 0.001
        and tcfg.moe_enable_routing_replay
    )


def mixtral_config(**over) -> dict:
    cfg = hf_config(
        "llama",
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=None,
        router_jitter_noise=0.0,
        max_position_embeddings=512,
    )
    cfg.update(over)
    return cfg


# (config, HF block of router and experts, expert (gate, up, down) names): the one per-family part
MOE_FAMILIES = {
    "qwen3_moe": (qwen3_moe_config, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (mixtral_config, "block_sparse_moe", ("w1", "w3", "w2")),
}


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_expert_names_both_spec_forms_round_trip(family):
    make_cfg, block, (gate_n, up_n, down_n) = MOE_FAMILIES[family]
    shape = ModelShape.from_hf(make_cfg())
    g = torch.Generator().manual_seed(3)
    e = f"model.layers.1.{block}.experts.2."
    hf = {
        e + n + ".weight": torch.randn(s, generator=g)
        for n, s in [(gate_n, (32, HIDDEN)), (up_n, (32, HIDDEN)), (down_n, (HIDDEN, 32))]
    }
    for fc1, fc2 in [
        (
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
        ),
        (
            "decoder.layers.1.mlp.experts.linear_fc1.weight2",
            "decoder.layers.1.mlp.experts.linear_fc2.weight2",
        ),
    ]:
        shards = [to_megatron_shard(fc1, hf.__getitem__, shape, r, 2) for r in range(2)]
        gate, up = hf[e + gate_n + ".weight"], hf[e + up_n + ".weight"]
        # like the dense fc1: [gate_r; up_r]
        assert torch.equal(shards[0], torch.cat([gate[:16], up[:16]]))
        back = from_megatron_shards(fc1, shards, shape)
        assert sorted(back) == sorted([e + gate_n + ".weight", e + up_n + ".weight"])
        assert torch.equal(back[e + gate_n + ".weight"], gate) and torch.equal(
            back[e + up_n + ".weight"], up
        )
        shards = [to_megatron_shard(fc2, hf.__getitem__, shape, r, 2) for r in range(2)]
        assert torch.equal(
            from_megatron_shards(fc2, shards, shape)[e + down_n + ".weight"],
            hf[e + down_n + ".weight"],
        )
    assert rule("decoder.layers.0.mlp.router.weight", shape) == (
        "replicated",
        [f"model.layers.0.{block}.gate.weight"],
    )
    with pytest.raises(KeyError, match="expert 4 >= num_experts 4"):
        rule("decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight", shape)


def test_mixtral_shape_router_and_no_qk_norm():
    cfg = mixtral_config()
    shape = ModelShape.from_hf(cfg)
    # Mixtral's intermediate_size is one expert's; its router always renormalises the top-k
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size, shape.norm_topk_prob) == (
        4,
        2,
        32,
        True,
    )
    assert not shape.qk_norm and not shape.qkv_bias
    tcfg, kw = megatron_config_from_hf(cfg)
    assert (
        tcfg.num_moe_experts == 4
        and tcfg.moe_ffn_hidden_size == 32
        and tcfg.moe_router_pre_softmax is False
    )
    assert not tcfg.qk_layernorm and not tcfg.add_qkv_bias and kw["rotary_base"] == 10000
    with pytest.raises(KeyError, match="no q/k norms"):
        rule("decoder.layers.0.self_attention.q_layernorm.weight", shape)
    del cfg["architectures"]  # model_type alone names the class too
    assert ModelShape.from_hf(cfg).architecture == "MixtralForCausalLM"
    # a window no sequence reaches (>= max_position_embeddings) is full attention: accepted
    assert ModelShape.from_hf(mixtral_config(sliding_window=512)).is_moe


@pytest.mark.parametrize(
    "over, words",
    [
        (
            dict(sliding_window=4096, max_position_embeddings=32768),
            "sliding_window=4096 < max_position_embeddings=32768",
        ),
        (dict(router_jitter_noise=0.01), "router_jitter_noise=0.01"),
        (dict(num_local_experts=0), "MixtralForCausalLM config.json has no `num_experts`"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    ],
)
def test_mixtral_configs_we_cannot_map_are_refused_by_key(over, words):
    with pytest.raises(UnsupportedModelError, match=re.escape(words)):
        ModelShape.from_hf(mixtral_config(**over))


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
        (dict(mlp_only_layers=[0]), "mlp_only_layers=[0]"),
        (dict(num_local_experts=0), "num_experts"),
        (dict(attention_bias=True), "attention_bias=true"),
    ],
)
def test_qwen3_moe_layouts_we_cannot_map_are_refused_by_key(over, words):
    with pytest.raises(UnsupportedModelError, match=re.escape(words)):
        ModelShape.from_hf(qwen3_moe_config(**over))


def test_bad_expert_parallel_layouts_name_the_field():
    with pytest.raises(
        ValueError, match=r"parallelism\.expert_model_parallel_size=3 does not divide .* 4 experts"
    ):
        megatron_config_from_hf(qwen3_moe_config(), ep=3)
    with pytest.raises(
        ValueError, match=r"parallelism\.expert_model_parallel_size=2 needs a mixture-of-experts"
    ):
        megatron_config_from_hf(hf_config("qwen2"), ep=2)
    with pytest.raises(ValueError, match=r"TP x EP x PP = 2 x 2 x 1.*expert_model_parallel_size"):
        check_expert_layout(ModelShape.from_hf(qwen3_moe_config()), 2, tp=2, pp=1, world=6)
    tcfg, _ = megatron_config_from_hf(qwen3_moe_config(), ep=2)
    assert tcfg.expert_model_parallel_size == 2


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_each_tp_ranks_pieces_tile_the_hf_tensors_exactly(arch, tp):
    """A weight sync without a gather: every TP rank's blocks (hf_pieces), placed by the engine's
    Assembler, give bit for bit what gathering the shards gives (from_megatron_shards); at TP 4 the
    last rank holds only vocabulary padding (130 of 256 rows) and sends an empty block."""
    from rlmega.megatron.hf_weights import hf_pieces
    from rlmega.sync.pieces import Assembler, Piece

    # groups split over TP
    shape = ModelShape.from_hf(hf_config(arch, num_key_value_heads=max(KV_HEADS, tp)), tp)
    hf = random_hf_tensors(shape, seed=tp)
    _, shards = round_trip(hf, shape, tp, megatron_names(shape))
    assembler, whole = Assembler(), {}
    for name, per_rank in shards.items():
        sent = [hf_pieces(name, s, shape, r, tp) for r, s in enumerate(per_rank)]
        kind, _ = rule(name, shape)
        if kind == "replicated":  # whole, from TP rank 0 alone
            assert all(not s for s in sent[1:]) and not any(
                isinstance(v, Piece) for v in sent[0].values()
            )
        else:
            assert all(isinstance(v, Piece) and v.of == tp for s in sent for v in s.values())
        for r in reversed(range(tp)):  # any order
            for hf_name, value in assembler.add(list(sent[r].items()), 1):
                whole[hf_name] = value if isinstance(value, torch.Tensor) else value.tensor()
    assert assembler.pending() == [] and sorted(whole) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(whole[key], value), key
    if tp == 4:
        last = hf_pieces("output_layer.weight", shards["output_layer.weight"][3], shape, 3, tp)[
            "lm_head.weight"
        ]
        assert last.tensor.shape == (0, HIDDEN) and last.start == VOCAB
