"""Hugging Face config.json -> Megatron TransformerConfig + GPTModel arguments, in one function.

    shape = ModelShape.from_hf(hf_config_dict, tp=2)
    tcfg, gpt_kwargs = megatron_config_from_hf(hf_config_dict, tp=2, pp=2, vpp=None)

Supported: Llama (LlamaForCausalLM) and Qwen2 (Qwen2ForCausalLM), also named only by model_type: GQA, RoPE theta and Llama-3
RoPE scaling, RMSNorm eps, SwiGLU, Qwen2's QKV bias, tied or untied embeddings. The vocabulary is
padded to a multiple of lcm(128, TP) so every TP rank holds an equal slice and the padded size
(hence a checkpoint) is the same for TP = 1, 2, 4, 8.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from megatron.core.transformer import TransformerConfig

from rlmega.config.hf_support import architecture, unsupported_reason

VOCAB_PAD_MULTIPLE = 128

# Fusions are CUDA kernels; off where the local (non-Transformer-Engine) spec runs.
_NO_FUSIONS = dict(
    gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    masked_softmax_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
)


class UnsupportedModelError(ValueError):
    pass


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers-4 keys or transformers-5 `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the weight layout conversion needs to know about a model (all global, unsharded)."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, hf: dict, tp: int = 1) -> "ModelShape":
        reason = unsupported_reason(hf)  # the same words as the config preflight's
        if reason:
            raise UnsupportedModelError(reason)
        arch = architecture(hf)  # also a config.json with only model_type (llama, qwen2)
        heads = hf["num_attention_heads"]
        return cls(
            architecture=arch,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            ffn_hidden_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            padded_vocab_size=padded_vocab_size(hf["vocab_size"], tp),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
        )


def megatron_config_from_hf(
    hf: dict, tp: int = 1, pp: int = 1, vpp: int | None = None,
    params_dtype: torch.dtype = torch.float32, cpu: bool = True,
) -> tuple[TransformerConfig, dict]:
    """The one place HF model hyper-parameters become Megatron's. Returns (config, GPTModel kwargs)."""
    shape = ModelShape.from_hf(hf, tp)
    theta, scaling = _rope(hf)
    rope_scaling_factor = None
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind != "llama3":
            raise UnsupportedModelError(f"rope_scaling type {kind!r}: only 'llama3' (or none) is supported")
        rope_scaling_factor = float(scaling["factor"])
    vpp = vpp if vpp and vpp > 1 else None
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # The interleaved schedule needs a group size; PP is Megatron's usual choice.
        microbatch_group_size_per_vp_stage=pp if vpp else None,
        # Interleaving with batched p2p mismatches messages when a stage's previous and next
        # stage are the same rank (PP=2): batched sends to one peer are matched in posting order,
        # so an activation lands in a gradient buffer. Megatron-LM's own default for
        # interleaving is separate, ordered sends; use it.
        overlap_p2p_comm=bool(vpp),
        batch_p2p_comm=not vpp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        # Losses return (sum, count): Megatron normalises by the global count over micro-batches
        # and data-parallel ranks, so RL loss aggregation is over the whole batch.
        calculate_per_token_loss=True,
        **(_NO_FUSIONS if cpu else {}),
    )
    gpt_kwargs = dict(
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )
    return config, gpt_kwargs
