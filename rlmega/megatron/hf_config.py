"""Hugging Face config.json -> Megatron TransformerConfig + GPTModel arguments, in one function.

    shape = ModelShape.from_hf(hf_config_dict, tp=2)
    tcfg, gpt_kwargs = megatron_config_from_hf(hf_config_dict, tp=2, pp=2, vpp=None)

Supported: Llama (LlamaForCausalLM), Qwen2 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM), Qwen3-MoE
(Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM), also named only by model_type: GQA, RoPE theta
and Llama-3 RoPE scaling, RMSNorm eps, SwiGLU, Qwen2's QKV bias, Qwen3's per-head q/k RMSNorm (Megatron
``qk_layernorm``), tied or untied embeddings; Qwen3-MoE's and Mixtral's routed experts (top-k softmax router,
``norm_topk_prob``, no shared experts); DeepSeek-V3 (``mla_config_kwargs``, docs/deepseek_v3_megatron.md) and
Gemma 3 (``gemma3_config_kwargs``, docs/gemma3_megatron.md).

Router equivalence (checked numerically by tests/multiproc/test_hf_parity.py): HF Qwen3-MoE takes
softmax over all experts, then top-k, then (norm_topk_prob) renormalises the k weights. That equals
softmax over the k top logits, which is Megatron's ``moe_router_pre_softmax=False``; without
norm_topk_prob it is Megatron's ``moe_router_pre_softmax=True`` (softmax first, top-k of the probs).
Mixtral's router (transformers' MixtralTopKRouter) is softmax, top-k, renormalise, always: norm_topk_prob.

The vocabulary is padded to a multiple of lcm(128, TP) so every TP rank holds an equal slice and the padded size
(hence a checkpoint) is the same for TP = 1, 2, 4, 8.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron.core.transformer import TransformerConfig

from rlmega.config.gemma3_layout import ARCH as GEMMA3
from rlmega.config.gemma3_layout import gemma3_layout
from rlmega.config.hf_support import (
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    architecture,
    num_experts,
    unsupported_reason,
)
from rlmega.config.value_model import causal_lm_config, is_value_model

VOCAB_PAD_MULTIPLE = 128

# Fusions are CUDA kernels; off where the local (non-Transformer-Engine) spec runs.
_NO_FUSIONS = dict(
    gradient_accumulation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_activation_fusion=False,
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
    scaling = hf.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else None
    )
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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (weights of size head_dim)
    num_experts: int = 0  # routed experts per layer; 0 = a dense model
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False
    # a critic: the output layer is hidden -> 1 (HF score.weight), never tied
    value_head: bool = False
    # DeepSeek-V3 (multi-latent attention, docs/deepseek_v3_megatron.md): q/k heads of qk_nope + qk_rope, v heads of
    # v_head; the latent q (q_lora) and kv (kv_lora) widths; a sigmoid router with a correction bias picking the
    # top group_topk of groups; shared experts of shared_ffn; the first first_dense layers a dense MLP
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router: str = "softmax"
    groups: int = 1
    group_topk: int = 1
    topk_scale: float = 1.0
    shared_ffn: int = 0
    first_dense: int = 0
    # Gemma 3 (rlmega/megatron/gemma3.py): norms after attention and MLP (HF post_attention_layernorm is then not the
    # pre-MLP norm: pre_feedforward_layernorm is), norms centred on 0, the embedding scale, sliding-window layers
    gemma3: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf: dict, tp: int = 1) -> "ModelShape":
        """A causal LM's shape; a critic's config (XForTokenClassification) gives its body's shape with
        ``value_head`` set (rlmega/config/value_model.py)."""
        if is_value_model(hf):
            return dataclasses.replace(cls.from_hf(causal_lm_config(hf), tp), value_head=True)
        reason = unsupported_reason(hf)  # the same words as the config preflight's
        if reason:
            raise UnsupportedModelError(reason)
        arch = architecture(hf)  # also a config.json with only model_type (llama, qwen2)
        heads = hf["num_attention_heads"]
        mla = cls._mla_fields(hf) if arch in MLA_ARCHITECTURES else {}
        return cls(
            architecture=arch,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=mla.pop("num_kv_heads", hf.get("num_key_value_heads") or heads),
            head_dim=mla.pop("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads),
            ffn_hidden_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            padded_vocab_size=padded_vocab_size(hf["vocab_size"], tp),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GEMMA3),
            gemma3=arch == GEMMA3,
            **(cls._moe_fields(hf) if arch in MOE_ARCHITECTURES else {}),
            **mla,
        )

    @staticmethod
    def _mla_fields(hf: dict) -> dict:
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        return dict(
            mla=True,
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf["v_head_dim"]),
            head_dim=nope + rope,
            num_kv_heads=int(hf["num_attention_heads"]),
            router="sigmoid",
            groups=int(hf.get("n_group") or 1),
            group_topk=int(hf.get("topk_group") or 1),
            topk_scale=float(hf.get("routed_scaling_factor") or 1.0),
            shared_ffn=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts") or 0),
            first_dense=int(hf.get("first_k_dense_replace") or 0),
        )

    @staticmethod
    def _moe_fields(hf: dict) -> dict:
        # every MLP is MoE: intermediate_size is one expert's
        if architecture(hf) == "MixtralForCausalLM":
            ffn, norm = int(hf["intermediate_size"]), True
        else:
            ffn, norm = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))
        return dict(
            num_experts=num_experts(hf),
            moe_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=ffn,
            norm_topk_prob=norm,
        )


def check_expert_layout(
    shape: ModelShape, ep: int, tp: int = 1, pp: int = 1, world: int | None = None
) -> None:
    """Refuse an expert-parallel layout that cannot hold the model, naming the config field."""
    if ep < 1:
        raise ValueError(f"parallelism.expert_model_parallel_size={ep} must be >= 1")
    if ep > 1 and not shape.is_moe:
        raise ValueError(
            f"parallelism.expert_model_parallel_size={ep} needs a mixture-of-experts model; "
            f"{shape.architecture} is dense: set it to 1"
        )
    if shape.is_moe and shape.num_experts % ep:
        raise ValueError(
            f"parallelism.expert_model_parallel_size={ep} does not divide the model's "
            f"{shape.num_experts} experts: pick a divisor of {shape.num_experts}"
        )
    if world is not None and world % (tp * ep * pp):
        raise ValueError(
            f"world size {world} is not divisible by TP x EP x PP = {tp} x {ep} x {pp} "
            "(expert tensor parallel = TP): change parallelism.expert_model_parallel_size "
            "or the world size"
        )


def moe_config_kwargs(
    shape: ModelShape,
    ep: int,
    aux_loss_coeff: float,
    z_loss_coeff: float,
    routing_replay: bool,
    cpu: bool = True,
    grouped_gemm: bool = False,
    bias_update_rate: float = 0.0,
) -> dict:
    """TransformerConfig's MoE fields for ``shape`` (empty for a dense model). ``bias_update_rate``:
    actor.moe_router_bias_update_rate (a sigmoid router's correction bias; refused for others by the config)."""
    if not shape.is_moe:
        return {}
    sigmoid = {}
    # DeepSeek-V3's router, as transformers computes it (docs/deepseek_v3_megatron.md)
    if shape.router == "sigmoid":
        sigmoid = dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,  # e_score_correction_bias: picks the experts, weighs nothing
            # actor.moe_router_bias_update_rate, default 0: the loaded bias stays as the checkpoint has it
            # (transformers never updates it); megatron-core's default 1e-3 would move it at every step with no word
            moe_router_bias_update_rate=float(bias_update_rate),
            moe_router_num_groups=shape.groups if shape.groups > 1 else None,
            moe_router_group_topk=shape.group_topk if shape.groups > 1 else None,
            moe_router_topk_scaling_factor=shape.topk_scale,
            moe_router_dtype="fp32",  # transformers' router linear and sigmoid run in float32
            moe_shared_expert_intermediate_size=shape.shared_ffn or None,
            moe_shared_expert_overlap=False,
            moe_layer_freq=[0] * shape.first_dense + [1] * (shape.num_layers - shape.first_dense),
        )
    return (
        sigmoid
        | dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_topk,
            moe_router_score_function=sigmoid.get("moe_router_score_function", "softmax"),
            moe_router_pre_softmax=not shape.norm_topk_prob,  # see the module docstring (softmax routers only)
            # The router's linear in the params' dtype, as HF's and vLLM's gate computes it (megatron's
            # softmax over the logits is fp32 either way).
            moe_router_dtype=sigmoid.get("moe_router_dtype"),
            # aux loss 0: no load-balancing term at all (Megatron's default type would still build one).
            moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(aux_loss_coeff),
            moe_z_loss_coeff=float(z_loss_coeff) if z_loss_coeff > 0 else None,
            moe_enable_routing_replay=bool(routing_replay),
            # The local spec's SequentialMLP (one Linear pair per expert, CPU) or, with Transformer Engine,
            # its grouped experts: must agree with the layer spec (model_manager.layer_spec).
            moe_grouped_gemm=grouped_gemm,
            # "alltoall" (megatron's choice at scale) opens torch.cuda.Stream()s for its split-size copies in
            # its constructor, which cannot run without CUDA; "allgather" only all-gathers tokens and
            # reduce-scatters results over the TP x EP group, which gloo does. On GPUs alltoall is used.
            moe_token_dispatcher_type="allgather" if cpu else "alltoall",
            expert_model_parallel_size=ep,
            moe_permute_fusion=False,
        )
    )


def mla_config_kwargs(
    shape: ModelShape,
    theta: float,
    scaling: dict | None,
    tp: int,
    context_parallel: int,
    sequence_parallel: bool,
) -> dict:
    """MLATransformerConfig's fields for DeepSeek-V3 (docs/deepseek_v3_megatron.md, each measured against
    transformers). megatron's ``qk_head_dim`` is the no-RoPE part; ``rotary_interleaved`` stays False for HF's
    ``rope_interleave: true`` (MLA's RoPE de-interleaves first, which is HF's interleaved rotation); the config's
    ``qk_layernorm`` is True for MLA: it keeps the latent q/kv norms (False makes them identities with no error)."""
    if context_parallel > 1:
        raise UnsupportedModelError(
            "parallelism.context_parallel_size > 1 with multi-latent attention (DeepSeek-V3) "
            "is not built: set it to 1"
        )
    if tp > 1 and not sequence_parallel:
        # megatron-core sums the q latent norm's gradient over TP by its name, right only when each TP rank saw
        # its share of the tokens (sequence parallelism); without it every rank's gradient is the whole one
        raise UnsupportedModelError(
            "multi-latent attention at TP > 1 needs parallelism.sequence_parallel=true"
        )
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "yarn":
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast", 32)),
            beta_slow=float(scaling.get("beta_slow", 1)),
            mscale=float(scaling.get("mscale") or 1.0),
            mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        )
    # the softmax scale reads mscale(rotary_scaling_factor, mscale_all_dim)^2 even for plain RoPE: make it 1
    else:
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(
        multi_latent_attention=True,
        q_lora_rank=shape.q_lora_rank or None,  # None: a plain q_proj
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        rotary_base=theta,
        rotary_interleaved=False,
        **rope,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (Gemma 3's MLP; module level: megatron-core's config is pickled)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def gemma3_config_kwargs(hf: dict, context_parallel: int) -> dict:
    """TransformerConfig's fields for Gemma 3 (rlmega/megatron/gemma3.py builds the rest; the tanh-GELU MLP is
    ``gelu_tanh``): norms centred on 0, the softmax scale, and megatron-core's sliding window, (window - 1, 0) on
    the layers that slide."""
    layout = gemma3_layout(hf)
    windows = {}
    if any(layout.sliding):
        if context_parallel > 1:
            raise UnsupportedModelError(
                "parallelism.context_parallel_size > 1 with sliding-window layers (Gemma 3) is "
                "not built: set it to 1"
            )
        windows = dict(
            window_size=(layout.window - 1, 0),
            window_attn_skip_freq=[int(s) for s in layout.sliding],
        )
    return dict(
        layernorm_zero_centered_gamma=True,
        softmax_scale=layout.query_pre_attn_scalar**-0.5,
        **windows,
    )


def megatron_config_from_hf(
    hf: dict,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    cpu: bool = True,
    ep: int = 1,
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: float = 0.0,
    routing_replay: bool = False,
    grouped_gemm: bool = False,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
    moe_router_bias_update_rate: float = 0.0,
) -> tuple[TransformerConfig, dict]:
    """The one place HF model hyper-parameters become Megatron's. Returns (config, GPTModel kwargs).

    ``ep`` (parallelism.expert_model_parallel_size), the aux/z-loss coefficients and ``routing_replay``
    (megatron's ``moe_enable_routing_replay``) only apply to MoE models; ep > 1 on a dense one is refused.
    ``grouped_gemm``: experts as Transformer Engine's grouped GEMM (TE layer spec) instead of SequentialMLP.
    ``sequence_parallel``: megatron-core's (TP > 1; a row's tokens split over the TP ranks outside attention
    and the MLP: the embedding scatters them, the output layer gathers them).
    ``context_parallel``: parallelism.context_parallel_size (rows split over CP ranks: context_parallel.py).
    """
    shape = ModelShape.from_hf(hf, tp)
    check_expert_layout(shape, ep)
    theta, scaling = _rope(hf)
    if shape.gemma3:  # RoPE per layer kind, the global layers' scaling set by gemma3.finish_model
        theta, scaling = gemma3_layout(hf).global_theta, None
    rope_scaling_factor = None
    if scaling and not shape.mla:  # MLA: its own RoPE (mla_config_kwargs)
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind != "llama3":
            raise UnsupportedModelError(
                f"rope_scaling type {kind!r}: only 'llama3' (or none) is supported"
            )
        rope_scaling_factor = float(scaling["factor"])
    vpp = vpp if vpp and vpp > 1 else None
    config_class, mla = TransformerConfig, {}
    if shape.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class, mla = (
            MLATransformerConfig,
            mla_config_kwargs(shape, theta, scaling, tp, context_parallel, sequence_parallel),
        )
    config = config_class(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=gelu_tanh if shape.gemma3 else torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm or shape.mla,  # Qwen3's q/k norms; MLA's latent q/kv norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        context_parallel_size=context_parallel,  # rows split by rlmega/megatron/context_parallel.py
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
        **moe_config_kwargs(
            shape,
            ep,
            moe_aux_loss_coeff,
            moe_z_loss_coeff,
            routing_replay,
            cpu,
            grouped_gemm,
            moe_router_bias_update_rate,
        ),
        **mla,
        **(gemma3_config_kwargs(hf, context_parallel) if shape.gemma3 else {}),
    )
    gpt_kwargs = dict(
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="none" if shape.mla else "rope",  # MLA rotates inside its attention
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )
    return config, gpt_kwargs
