"""Weight names and layouts between Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral/DeepSeek-V3/Gemma 3 and Megatron
GPT, per tensor.

Pure functions on tensors, no process groups: the callers (``hf_io``) decide which tensors a rank
reads or gathers. Megatron names here are *global*: ``decoder.layers.{L}`` uses the model-wide
layer index L (0-based), whatever pipeline stage or virtual chunk holds it, and MoE experts use the
model-wide expert index E, whatever expert-parallel rank holds it (``hf_io.global_named_parameters``).

Layouts (h = hidden, d = head_dim, H heads, G KV groups, F = ffn, V/Vp = vocab/padded vocab):
    linear_qkv.weight (G*(H/G+2)*d, h): per KV group g, [q heads of g; k_g; v_g] -- so a TP
        split along dim 0 hands each rank whole groups.          <- q_proj, k_proj, v_proj
    linear_fc1.weight (2F, h) on one rank; on TP rank r: [gate_r; up_r]   <- gate_proj, up_proj
    linear_proj.weight (h, H*d) / linear_fc2.weight (h, F): TP split along dim 1
    word_embeddings / output_layer (Vp, h): zero rows past V, TP split along dim 0
    norms (incl. Qwen3's q_layernorm/k_layernorm (d,)): replicated
    MoE: mlp.router.weight (num_experts, h) replicated  <- <block>.gate
        expert E: mlp.experts.local_experts.{E}.linear_fc1.weight (local spec, SequentialMLP) or
        mlp.experts.linear_fc1.weight{E} (Transformer Engine's grouped experts): like the dense
        linear_fc1 / linear_fc2, split over expert TP (= TP)     <- <block>.experts.{E}.{gate,up,down}
        where (MOE_HF_NAMES) Qwen3-MoE: <block> = mlp, gate/up/down = gate_proj/up_proj/down_proj;
        Mixtral: <block> = block_sparse_moe, gate/up/down = w1/w3/w2.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

# the per-family HF names of the router and experts
from rlmega.config.hf_support import MOE_HF_NAMES
from rlmega.config.value_model import VALUE_HEAD
from rlmega.megatron.hf_config import ModelShape
from rlmega.sync.pieces import Piece

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Expert parameters, both spec forms: (fc1|fc2, expert index).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12])\.weight|linear_(fc[12])\.weight(\d+))$"
)

# Megatron layer-suffix -> (kind, HF suffixes). TE fuses the norms into the next linear, so the
# same HF norm has two possible Megatron names.
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": ("split_dim1", ("self_attn.o_proj.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("split_dim1", ("mlp.down_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "mlp.router.weight": ("replicated", ("<block>.gate.weight",)),  # <block>: MOE_HF_NAMES
    # DeepSeek-V3 (docs/deepseek_v3_megatron.md): multi-latent attention's projections, the up-projections split
    # along their output rows (whole heads per TP rank), the latent down-projections whole on every rank
    # (rlmega/megatron/mla.py; hf_io reads a parameter that is not TP-split whole); the router's correction
    # bias (megatron's expert_bias, a buffer); the shared experts
    "self_attention.linear_q_proj.weight": (
        "rows",
        ("self_attn.q_proj.weight",),
    ),  # q_lora_rank null
    "self_attention.linear_q_down_proj.weight": ("rows", ("self_attn.q_a_proj.weight",)),
    "self_attention.linear_q_up_proj.weight": ("rows", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("rows", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("rows", ("self_attn.kv_b_proj.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "mlp.router.expert_bias": ("replicated", ("<block>.gate.e_score_correction_bias",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    ),
    "mlp.shared_experts.linear_fc2.weight": (
        "split_dim1",
        ("mlp.shared_experts.down_proj.weight",),
    ),
}
# Gemma 3 (rlmega/megatron/gemma3.py): the norms after attention and after the MLP live in those sublayers; its HF
# post_attention_layernorm is the former, and its pre-MLP norm is pre_feedforward_layernorm
_GEMMA3_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pre_mlp_layernorm.weight": ("replicated", ("pre_feedforward_layernorm.weight",)),
    "self_attention.post_attention_norm.weight": (
        "replicated",
        ("post_attention_layernorm.weight",),
    ),
    "mlp.post_mlp_norm.weight": ("replicated", ("post_feedforward_layernorm.weight",)),
}
_MLA_ONLY = (
    "self_attention.linear_q_proj.",
    "self_attention.linear_q_down_proj.",
    "self_attention.linear_q_up_proj.",
    "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.kv_layernorm.",
    "mlp.shared_experts.",
    "mlp.router.expert_bias",
)
# fc1 / fc2 -> (kind, indices into the (gate, up, down) names)
_EXPERT_RULES = {"fc1": ("gate_up", (0, 1)), "fc2": ("split_dim1", (2,))}


def expert_index(mcore_name: str) -> int | None:
    """The expert index in a Megatron expert parameter's name (None for a non-expert parameter)."""
    m = _LAYER.match(mcore_name)
    e = _EXPERT.match(m.group(2)) if m else None
    if e is None:
        return None
    return int(e.group(1) if e.group(1) is not None else e.group(4))


def with_expert_index(mcore_name: str, index: int) -> str:
    """``mcore_name`` with its expert index replaced by ``index`` (same spec form)."""
    m = _LAYER.match(mcore_name)
    e = _EXPERT.match(m.group(2))
    if e.group(1) is not None:
        suffix = f"mlp.experts.local_experts.{index}.linear_{e.group(2)}.weight"
    else:
        suffix = f"mlp.experts.linear_{e.group(3)}.weight{index}"
    return f"decoder.layers.{m.group(1)}.{suffix}"


_GLOBAL_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
}


def rule(mcore_name: str, shape: ModelShape) -> tuple[str, list[str]]:
    """(layout kind, HF tensor names) for a global Megatron parameter name."""
    m = _LAYER.match(mcore_name)
    if m:
        layer, suffix = m.groups()
        e = _EXPERT.match(suffix)
        if e is not None:
            if not shape.is_moe:
                raise KeyError(f"{mcore_name!r}: {shape.architecture} has no experts")
            expert, fc = (
                (e.group(1), e.group(2)) if e.group(1) is not None else (e.group(4), e.group(3))
            )
            if int(expert) >= shape.num_experts:
                raise KeyError(
                    f"{mcore_name!r}: expert {expert} >= num_experts {shape.num_experts}"
                )
            block, projections = MOE_HF_NAMES[shape.architecture]
            kind, which = _EXPERT_RULES[fc]
            return kind, [
                f"model.layers.{layer}.{block}.experts.{expert}.{projections[i]}.weight"
                for i in which
            ]
        if shape.gemma3 and suffix in _GEMMA3_RULES:
            kind, hf_suffixes = _GEMMA3_RULES[suffix]
            return kind, [f"model.layers.{layer}.{s}" for s in hf_suffixes]
        if suffix not in _LAYER_RULES:
            raise KeyError(f"no HF mapping for Megatron parameter {mcore_name!r}")
        kind, hf_suffixes = _LAYER_RULES[suffix]
        if suffix.startswith(_MLA_ONLY) and not shape.mla:
            raise KeyError(
                f"{mcore_name!r}: {shape.architecture} has no multi-latent attention or shared experts"
            )
        if (
            suffix.endswith("_layernorm.weight")
            and suffix.startswith("self_attention.")
            and not (shape.qk_norm or shape.mla)
        ):
            raise KeyError(f"{mcore_name!r}: {shape.architecture} has no q/k norms")
        # MLA's latent q norm, not a head norm
        if suffix == "self_attention.q_layernorm.weight" and shape.mla:
            return kind, [f"model.layers.{layer}.self_attn.q_a_layernorm.weight"]
        if suffix in ("mlp.router.weight", "mlp.router.expert_bias"):
            if not shape.is_moe:
                raise KeyError(
                    f"{mcore_name!r}: {shape.architecture} has no router (a dense model)"
                )
            leaf = "weight" if suffix.endswith("weight") else "e_score_correction_bias"
            return kind, [f"model.layers.{layer}.{MOE_HF_NAMES[shape.architecture][0]}.gate.{leaf}"]
        if kind == "qkv" and suffix.endswith("bias") and not shape.qkv_bias:
            raise KeyError(f"{mcore_name!r}: {shape.architecture} has no QKV bias")
        return kind, [f"model.layers.{layer}.{s}" for s in hf_suffixes]
    if mcore_name not in _GLOBAL_RULES:
        raise KeyError(f"no HF mapping for Megatron parameter {mcore_name!r}")
    kind, names = _GLOBAL_RULES[mcore_name]
    if mcore_name == "output_layer.weight" and shape.value_head:
        return "replicated", [VALUE_HEAD]  # a critic's hidden -> 1 head, whole on every TP rank
    if mcore_name == "output_layer.weight" and shape.tie_word_embeddings:
        names = ("model.embed_tokens.weight",)  # tied: the head is the embedding
    return kind, list(names)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """q (H*d, ...), k and v (G*d, ...) -> (G*(H/G+2)*d, ...) grouped [q_g; k_g; v_g]."""
    g, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    return [t.reshape(-1, *fused.shape[1:]) for t in _qkv_views(fused, shape)]


def _qkv_views(fused: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """q, k, v of a fused [groups * (q_per_group + 2) * head_dim, *rest] tensor (all its KV groups, or
    one TP shard's), as views of shape [groups, rows_per_group, *rest]."""
    g, d = shape.num_kv_heads, shape.head_dim
    rest = fused.shape[1:]
    return list(
        fused.reshape(-1, (shape.num_heads // g + 2) * d, *rest).split(
            [shape.num_heads // g * d, d, d], dim=1
        )
    )


def hf_pieces(
    mcore_name: str, shard: torch.Tensor, shape: ModelShape, tp_rank: int, tp_size: int
) -> dict[str, Piece | torch.Tensor]:
    """What TP rank ``tp_rank`` sends of one Megatron parameter, without a gather: its block of each HF
    tensor (rlmega/sync/pieces.py), or for a replicated parameter the whole tensor from rank 0 alone.

    The blocks of all ranks tile each HF tensor exactly (``from_megatron_shards`` of all the shards):
    q/k/v and gate/up rows, o/down columns, vocabulary rows (the padding rows past the vocabulary
    dropped: a rank holding only padding sends an empty block, so every tensor gets ``tp_size`` pieces).
    """
    kind, names = rule(mcore_name, shape)
    if kind == "replicated" or tp_size == 1:
        if tp_rank:
            return {}
        return from_megatron_shards(mcore_name, [shard], shape)

    def rows(t: torch.Tensor, total: int) -> Piece:  # rank tp_rank's equal block of ``total`` rows
        return Piece(t.contiguous(), (total, *t.shape[1:]), 0, tp_rank * t.shape[0], tp_size)

    if kind == "split_dim1":
        cols = shard.shape[1]
        return {
            names[0]: Piece(
                shard.contiguous(), (shard.shape[0], cols * tp_size), 1, tp_rank * cols, tp_size
            )
        }
    if kind == "rows":
        return {names[0]: rows(shard, shard.shape[0] * tp_size)}
    if kind == "qkv":
        rest = shard.shape[1:]
        q, k, v = (t.reshape(-1, *rest) for t in _qkv_views(shard, shape))  # (copies: strided rows)
        d = shape.head_dim
        return {
            names[0]: rows(q, shape.num_heads * d),
            names[1]: rows(k, shape.num_kv_heads * d),
            names[2]: rows(v, shape.num_kv_heads * d),
        }
    if kind == "gate_up":
        gate, up = shard.chunk(2, dim=0)
        return {
            names[0]: rows(gate, gate.shape[0] * tp_size),
            names[1]: rows(up, up.shape[0] * tp_size),
        }
    if kind == "vocab":
        start = min(tp_rank * shard.shape[0], shape.vocab_size)
        mine = shard[: min(shard.shape[0], shape.vocab_size - start)]
        return {
            names[0]: Piece(
                mine.contiguous(), (shape.vocab_size, *shard.shape[1:]), 0, start, tp_size
            )
        }
    raise AssertionError(kind)


def to_megatron_shard(
    mcore_name: str,
    get_hf: Callable[[str], torch.Tensor],
    shape: ModelShape,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """The TP-rank slice of one Megatron parameter, built from HF tensors fetched by name."""
    kind, names = rule(mcore_name, shape)
    hf = [get_hf(n) for n in names]
    if kind == "replicated":
        return hf[0]
    if kind == "split_dim1":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "rows":
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if kind == "qkv":
        return _fuse_qkv(*hf, shape).chunk(tp_size, dim=0)[tp_rank]
    if kind == "gate_up":
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    if kind == "vocab":
        full = hf[0]
        pad = shape.padded_vocab_size - full.shape[0]
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
        return full.chunk(tp_size, dim=0)[tp_rank]
    raise AssertionError(kind)


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, except that one tensor (TP 1) is returned as it is: a view, not a copy."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def from_megatron_shards(
    mcore_name: str, shards: list[torch.Tensor], shape: ModelShape
) -> dict[str, torch.Tensor]:
    """HF tensors from all TP shards (in TP-rank order) of one Megatron parameter.

    With one shard the results may be views of it (no copy): callers that keep them past the
    next update of the parameter must copy them.
    """
    kind, names = rule(mcore_name, shape)
    if kind == "replicated":
        return {names[0]: shards[0]}
    if kind == "split_dim1":
        return {names[0]: _cat(shards, dim=1)}
    if kind == "rows":
        return {names[0]: _cat(shards, dim=0)}
    if kind == "qkv":
        if len(shards) == 1:
            return dict(zip(names, _split_qkv(shards[0], shape)))
        # each shard holds whole KV groups: split it, then one cat per q/k/v (one copy, not a cat of
        # the shards followed by a copying reshape of each strided part)
        parts = [_qkv_views(s, shape) for s in shards]
        rest = shards[0].shape[1:]
        return {
            n: torch.cat([p[i] for p in parts], dim=0).reshape(-1, *rest)
            for i, n in enumerate(names)
        }
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: _cat([h[0] for h in halves]), names[1]: _cat([h[1] for h in halves])}
    if kind == "vocab":
        return {names[0]: _cat(shards, dim=0)[: shape.vocab_size]}
    raise AssertionError(kind)
