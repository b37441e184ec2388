"""Attention over packed rows, one causal sdpa call per sequence: ``attn_implementation="rlmega_packed_sdpa"``.

transformers' own sdpa path reads packed sequences from position ids that restart and builds a
(T, T) block-diagonal causal mask; sdpa with an explicit mask then computes every (query, key)
pair of the row, i.e. T^2 scores, of which only sum(len_i^2) / 2 are kept. For a 2048-token row of
~20 RL samples that is ~20x the needed work, and on CPU it was 43% of an FSDP train step
(tools/bench/train_step.py: 2.5 of 5.8 s). Here each sequence's slice of q/k/v goes through
transformers' ``sdpa_attention_forward`` with ``is_causal=True`` (no mask: the flash kernels skip the
masked blocks), and the outputs are concatenated back into the row. The arithmetic per sequence is
that of unpacked sdpa, so packing changes no log-prob beyond kernel rounding.

Sequence boundaries come from the ``position_ids`` transformers hands every attention call: a new
sequence starts wherever a position is not the previous one + 1 (as ``find_packed_sequence_indices``
reads them). Registered under a name of its own, so transformers builds no mask for it at all
(masking_utils skips implementations it has no mask function for). Sliding windows are honoured by
an explicit windowed causal mask for a sequence longer than the window; a cache or attention sinks
are refused by name. Padding masks are not: transformers drops a 2-D ``attention_mask`` before it
reaches a mask-less implementation, so callers give packed rows (forward.py does), never padded ones.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlmega.fsdp import ulysses

NAME = "rlmega_packed_sdpa"


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end), ...] of the sequences in one packed row. position_ids: (1, T) or (T,)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    cuts = [0, *starts.tolist(), pos.numel()]
    return list(zip(cuts[:-1], cuts[1:]))


def packed_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                  scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention-function contract: query (B, H, T, D), key/value (B, H_kv, T, D) ->
    (output (B, T, H, D), None). Causal within each sequence of the packed row, nothing across. B > 1
    only when every row has the same sequences (a plain batch: one causal sequence per row)."""
    if attention_mask is not None:
        raise ValueError(f"{NAME} takes packed rows without an attention_mask (sequences are read from position_ids)")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{NAME}: packed rows without a cache, got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{NAME} does not implement attention sinks; use attn_implementation='sdpa'")
    position_ids = kwargs.pop("position_ids", None)
    shard = ulysses.current()
    if shard is not None:  # Ulysses: this rank's heads over the whole row, then back (rlmega/fsdp/ulysses.py)
        query, key, value = (ulysses.seq_to_heads(t, shard) for t in (query, key, value))
        out = _per_sequence(module, query, key, value, shard.full_position_ids.to(query.device), dropout, scaling,
                            sliding_window)
        return ulysses.heads_to_seq(out.transpose(1, 2), shard).transpose(1, 2), None
    return _per_sequence(module, query, key, value, position_ids, dropout, scaling, sliding_window), None


def _per_sequence(module, query, key, value, position_ids, dropout, scaling, sliding_window) -> torch.Tensor:
    """query (B, H, T, D), key/value (B, H_kv, T, D) -> (B, T, H, D): causal sdpa per sequence of the row."""
    if position_ids is not None and position_ids.shape[0] > 1:  # rows must share one layout (e.g. unpacked)
        if not torch.equal(position_ids, position_ids[:1].expand_as(position_ids)):
            raise ValueError(f"{NAME}: rows of a batch packed differently; pack into one row per micro-batch")
        position_ids = position_ids[:1]
    bounds = [(0, query.shape[2])] if position_ids is None else sequence_bounds(position_ids)
    # split, not slicing: the backward of a split is one cat, that of each slice a zero-filled (1, H, T, D)
    lengths = [e - s for s, e in bounds]
    outs = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value))):
        mask = None
        if sliding_window is not None and q.shape[2] > sliding_window:
            i = torch.arange(q.shape[2], device=q.device)
            d = i[:, None] - i[None, :]
            mask = ((d >= 0) & (d < sliding_window))[None, None]  # (1, 1, t, t), True = attend
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=True)
        outs.append(out)  # (1, t, H, D)
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


AttentionInterface.register(NAME, packed_sdpa_attention_forward)
