"""Core attention of the local layer spec: torch's fused SDPA, causal within each packed sequence.

Megatron-core's local ``DotProductAttention`` materialises the (B*heads, S, S) scores of a whole
packed row and runs mask and softmax unfused: every (query, key) pair of the row is computed, of which
only sum(len_i^2) / 2 are kept. Here each sequence of a row goes through
``scaled_dot_product_attention(is_causal=True)`` on its own slice (the flash kernel on CPU and GPU: no
score matrix, no masked blocks), and the outputs are concatenated back. A row's tail (padding, and the
all-padding rows an expert-parallel micro-batch may add) is one causal segment of its own; its outputs
are never read (loss mask 0; MoE routers get the padding mask).

RoPE is applied here, just before the attention, not by Megatron's attention: its
``apply_rotary_pos_emb`` takes cos and sin of the angles in every layer, for q and for k, and rotates
with two ``cat``s. Here cos and sin are computed once per forward, at each token's position in its own
sequence (as vLLM and transformers rotate), and a rotation is one multiply and two in-place
multiply-adds. Inside ``packed_rows`` the model's ``rotary_pos_emb`` returns None, so Megatron's
attention applies none of its own.

    with packed_rows(model_chunk, position_ids, row_cu) as params:      # position_ids (B, S)
        logits = model_chunk(tokens, position_ids, None, packed_seq_params=params)

A layer megatron-core's ``window_size`` / ``window_attn_skip_freq`` make a sliding-window one (Gemma 3's) attends
within the window per sequence (rlmega/algorithms/sliding_window.py), rotated by the chunk's window RoPE where it
has one (``RowPacking.window_cos``).

Called without ``packed_rows`` (no ``RowPacking``), the module is plain causal SDPA (or SDPA under the
given boolean mask, True = may not attend) and Megatron applies RoPE as usual; a sliding-window layer refuses.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from rlmega.algorithms.sliding_window import windowed_causal_attention
from rlmega.megatron.hf_io import unwrap


@dataclasses.dataclass
class RowPacking(PackedSeqParams):
    """Packed rows (B, S) in Megatron's sbhd layout: ``qkv_format="sbhd"``, so Megatron's attention hands
    it to the core attention untouched (only "thd" changes what it does).

    ``segments``: lengths of the causal segments over the rows' tokens, row-major (sum = B * S).
    ``cos`` (S, B, 1, head_dim), ``sin`` (S, B, 1, head_dim / 2): of each token's angles (cos repeated
    for both halves), or None (no RoPE in the model).
    ``cp``: under context parallelism, this rank's share of the row (rlmega/megatron/context_parallel.py's
    ``CPShare``: S is the local length; its ``attend`` gathers K and V over the CP group).
    ``window_cos`` / ``window_sin``: the angles of the sliding-window layers where they rotate with a base of
    their own (Gemma 3's ``rope_local_base_freq``: the model chunk's ``rlmega_window_rope``), else None.
    """

    segments: list[int] = dataclasses.field(default_factory=list)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    window_cos: torch.Tensor | None = None
    window_sin: torch.Tensor | None = None
    # context_parallel.CPShare of a row split over the CP group: it attends
    cp: object | None = None


def row_segments(row_cu: list[list[int]], rows: int, row_len: int) -> list[int]:
    """Segment lengths of ``rows`` rows of ``row_len`` tokens: each row's sequences (offsets ``row_cu[r]``,
    from 0 to the row's used length), then its padding tail; rows beyond ``row_cu`` are all padding."""
    segments = []
    for r in range(rows):
        cu = row_cu[r] if r < len(row_cu) else [0]
        segments += [e - s for s, e in zip(cu[:-1], cu[1:])]
        if row_len > cu[-1]:
            segments.append(row_len - cu[-1])
    return segments


@contextmanager
def packed_rows(chunk, position_ids: torch.Tensor, row_cu: list[list[int]], cp=None):
    """The ``RowPacking`` of one micro-batch for ``chunk``'s forward passes inside this block.

    position_ids: (B, S), each token's position in its own sequence (they restart per sequence).
    While the block is open the chunk's rotary embedding returns None (RoPE happens in the core
    attention, from the cos/sin here): a shadow of its (cached) forward, removed on exit. Angles at each
    token's position in its own sequence, not at its offset in the row: equal in exact arithmetic, but
    the float32 angle t*f carries rounding up to ulp(t*f)/2 (1.5e-5 rad at t=500), which cost 1.2e-4 in
    log-probs against vLLM on the demo's trained model with 512-token rows (tools/parity_probe.py).
    Yields None, touching nothing, for a chunk whose attention is not ``PackedSDPAttention`` (TE).
    ``cp``: the micro-batch's context-parallel CPShare (position_ids are then this rank's slots').
    """
    B, S = position_ids.shape
    model = unwrap(chunk)
    if not uses_packed_sdpa(model):
        yield None
        return
    mla_ropes = _mla_rotary_embeddings(model)
    # multi-latent attention rotates inside its layers: give them each token's own angles
    if mla_ropes:
        with _per_token_mla_rope(mla_ropes, position_ids):
            yield RowPacking(
                qkv_format="sbhd",
                max_seqlen_q=S,
                max_seqlen_kv=S,
                segments=row_segments(row_cu, B, S),
            )
        return
    rope = getattr(model, "rotary_pos_emb", None)
    cos, sin = _angles(rope, position_ids, model.config) if rope is not None else (None, None)
    # Gemma 3's sliding layers: a base of their own
    window_rope = getattr(model, "rlmega_window_rope", None)
    window_cos = window_sin = None
    if window_rope is not None:
        window_cos, window_sin = _angles(window_rope, position_ids, model.config)
    params = RowPacking(
        qkv_format="sbhd",
        max_seqlen_q=S,
        max_seqlen_kv=S,
        segments=[] if cp is not None else row_segments(row_cu, B, S),
        cos=cos,
        sin=sin,
        cp=cp,
        window_cos=window_cos,
        window_sin=window_sin,
    )
    if rope is not None:
        rope.forward = lambda *args, **kwargs: None
    try:
        yield params
    finally:
        if rope is not None:
            del rope.forward


def _angles(rope, position_ids: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos (S, B, 1, dim), sin (S, B, 1, dim / 2) of each token's position (``position_ids`` (B, S)) under megatron's
    rotary embedding ``rope``: its own angles (inverse frequencies, scaling), computed in float32, then cast to the
    activations' dtype, as Megatron's rotation casts them."""
    # (L, 1, 1, dim): [freqs, freqs] (not interleaved)
    table = rope.get_emb(int(position_ids.max()) + 1)
    if config.rotary_interleaved or table.shape[-1] != config.kv_channels:
        raise ValueError(
            "packed_rows: RoPE over whole heads, halves rotated (HF Llama/Qwen) only; got "
            f"interleaved={config.rotary_interleaved}, rotary dim {table.shape[-1]} of "
            f"head dim {config.kv_channels}"
        )
    half = table[..., : table.shape[-1] // 2].to(position_ids.device)
    angles = half[position_ids.t()].squeeze(3)  # (S, B, 1, dim / 2)
    dtype = config.params_dtype
    return torch.cos(angles).repeat(1, 1, 1, 2).to(dtype), torch.sin(angles).to(dtype)


def _mla_rotary_embeddings(model) -> list:
    """The rotary embedding module of every multi-latent attention layer of the chunk (DeepSeek-V3's)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return [m.rotary_pos_emb for m in model.modules() if isinstance(m, MultiLatentAttention)]


@contextmanager
def _per_token_mla_rope(ropes: list, position_ids: torch.Tensor):
    """While open, each MLA layer's rotary embedding returns the angles of each token at its position in its own
    sequence, (S, B, 1, dim) (with yarn's mscale, as its own forward returns it), instead of those of row
    offsets 0..S-1: the same rows of its own table, so a sequence packed anywhere in a row rotates as alone."""
    # (L, 1, 1, dim), or (that, mscale) for yarn
    table = ropes[0].get_emb(int(position_ids.max()) + 1)
    emb, mscale = table if isinstance(table, tuple) else (table, None)
    per_token = emb[position_ids.t().to(emb.device)][:, :, 0]  # (S, B, 1, dim)
    out = per_token if mscale is None else (per_token, mscale)
    for rope in ropes:
        rope.forward = lambda *args, **kwargs: out
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward


def uses_packed_sdpa(model) -> bool:
    """Whether this (unwrapped) model chunk's layers attend with ``PackedSDPAttention``."""
    found = getattr(model, "_rlmega_packed_sdpa", None)
    if found is None:
        found = any(isinstance(m, PackedSDPAttention) for m in model.modules())
        model._rlmega_packed_sdpa = found
    return found


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves: x (S, B, H, D); cos (S, B, 1, D), sin (S, B, 1, D/2) -> (S, B, H, D), a new tensor.

    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], Megatron's non-interleaved rotation without its
    ``cat``s: one multiply, then two multiply-adds in place on the halves of the result.
    """
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos
    half = x1.shape[-1]
    out[..., :half].addcmul_(x2, sin, value=-1.0)
    out[..., half:].addcmul_(x1, sin)
    return out


class PackedSDPAttention(MegatronModule):
    """Drop-in for megatron-core's ``DotProductAttention`` (same constructor and forward contract):
    query (S, B, heads/tp, D), key/value (S, B, groups/tp, D) -> (S, B, heads/tp * D)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        # k_channels / v_channels: multi-latent attention's q/k and v head sizes (rlmega/megatron/mla.py); the
        # attention reads them from the tensors, and MLA passes its softmax_scale
        super().__init__(config=config)
        # then only rows split by context_parallel.py
        self.context_parallel = config.context_parallel_size > 1
        if config.softmax_type != "vanilla":
            raise ValueError(
                "PackedSDPAttention: softmax offsets (attention sinks) are not supported"
            )
        # megatron-core's sliding window for this layer (layer_number: 1-based, model-wide), (left, 0): a query sees
        # itself and the ``left`` keys before it, so transformers' / vLLM's sliding_window is left + 1
        self.window = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise ValueError(
                    f"PackedSDPAttention: window_size={config.window_size}: causal windows (left, 0) only"
                )
            if self.context_parallel:
                raise ValueError(
                    "PackedSDPAttention: sliding windows under context parallelism are not built"
                )
            self.window = left + 1
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        # apply_query_key_layer_scaling: Megatron divides the scale by the layer number and multiplies
        # it back inside its fp32 softmax, so the product is this plain scale either way
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("PackedSDPAttention: attention_bias is not supported")
        S, B = query.shape[:2]
        dropout = self.dropout if self.training else 0.0
        gqa = query.shape[2] != key.shape[2]
        if not isinstance(packed_seq_params, RowPacking):
            if self.context_parallel or packed_seq_params is not None:
                raise ValueError(
                    "PackedSDPAttention takes RowPacking (under context parallelism: its rows split "
                    "by context_parallel.py) or no packing, got "
                    f"{getattr(packed_seq_params, 'qkv_format', None)!r}"
                )
            if self.window is not None:  # its window and its own RoPE come with packed_rows only
                raise ValueError(
                    "PackedSDPAttention: a sliding-window layer runs under packed_attention.packed_rows"
                )
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (B, H, S, D)
            mask = None if attention_mask is None else ~attention_mask
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
            return out.permute(2, 0, 1, 3).reshape(S, B, -1)  # (S, B, H*D)
        cos, sin = packed_seq_params.cos, packed_seq_params.sin
        if self.window is not None and packed_seq_params.window_cos is not None:
            cos, sin = packed_seq_params.window_cos, packed_seq_params.window_sin
        if cos is not None:
            query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        if packed_seq_params.cp is not None:
            return packed_seq_params.cp.attend(
                query, key, value, self.softmax_scale, dropout
            ).reshape(S, B, -1)
        if self.context_parallel:
            raise ValueError(
                "PackedSDPAttention under context parallelism takes rows split by "
                "rlmega/megatron/context_parallel.py (RowPacking.cp)"
            )
        # rows one after the other: (B*S, H, D); split, not slicing: the backward of a split is one cat
        q, k, v = (t.transpose(0, 1).reshape(B * S, *t.shape[2:]) for t in (query, key, value))
        outs = []
        for qs, ks, vs in zip(*(t.split(packed_seq_params.segments) for t in (q, k, v))):
            qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))  # (1, H, len, D)
            if self.window is not None:
                o = windowed_causal_attention(
                    qs, ks, vs, self.window, self.softmax_scale, dropout, gqa
                )
            else:
                o = F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    dropout_p=dropout,
                    is_causal=True,
                    scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
            outs.append(o[0].transpose(0, 1))  # (len, H, D)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # (B*S, H, D)
        return out.reshape(B, S, -1).transpose(0, 1).contiguous()  # (S, B, H*D)
