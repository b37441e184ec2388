"""Attention over packed rows, one causal sdpa call per sequence: ``attn_implementation="rlmega_packed"``.

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
(masking_utils skips implementations it has no mask function for); the name does not contain "sdpa",
so transformers does not refuse it for a model class without an sdpa path (GPT-OSS: its sinks). Sliding
windows are honoured by an explicit windowed causal mask for a sequence longer than the window.
Attention sinks (GPT-OSS's ``s_aux``: one learned logit per head that takes softmax mass and adds no
value) have no sdpa form, so those sequences run ``sink_attention``, eager: (len, len) scores per head
in memory, as transformers' own GPT-OSS eager path. A cache is refused by name. Padding masks are not:
transformers drops a 2-D ``attention_mask`` before it reaches a mask-less implementation, so callers give
packed rows (forward.py does), never padded ones.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlmega.fsdp import ulysses

NAME = "rlmega_packed"


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end), ...] of the sequences in one packed row. position_ids: (1, T) or (T,)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    cuts = [0, *starts.tolist(), pos.numel()]
    return list(zip(cuts[:-1], cuts[1:]))


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """transformers' attention-function contract: query (B, H, T, D), key/value (B, H_kv, T, D) ->
    (output (B, T, H, D), None). Causal within each sequence of the packed row, nothing across. B > 1
    only when every row has the same sequences (a plain batch: one causal sequence per row)."""
    if attention_mask is not None:
        raise ValueError(
            f"{NAME} takes packed rows without an attention_mask (sequences are read from position_ids)"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{NAME}: packed rows without a cache, got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}"
        )
    sinks = kwargs.get("s_aux")
    position_ids = kwargs.pop("position_ids", None)
    shard = ulysses.current()
    # Ulysses: this rank's heads over the whole row, then back (rlmega/fsdp/ulysses.py)
    if shard is not None:
        # the preflight refuses actor.ulysses_size > 1 for such a family first
        if sinks is not None:
            raise ValueError(
                f"{NAME}: attention sinks under Ulysses (each rank would need its heads' sinks)"
            )
        query, key, value = (ulysses.seq_to_heads(t, shard) for t in (query, key, value))
        out = _per_sequence(
            module,
            query,
            key,
            value,
            shard.full_position_ids.to(query.device),
            dropout,
            scaling,
            sliding_window,
        )
        return ulysses.heads_to_seq(out.transpose(1, 2), shard).transpose(1, 2), None
    return _per_sequence(
        module, query, key, value, position_ids, dropout, scaling, sliding_window, sinks
    ), None


def _window_mask(t: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """(1, 1, t, t) bool, True = attend: causal within the last ``sliding_window`` positions (None: no window
    reaches past a sequence of ``t`` tokens, plain causal)."""
    if sliding_window is None or t <= sliding_window:
        return None
    i = torch.arange(t, device=device)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < sliding_window))[None, None]


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention of one sequence with a sink logit per head (GPT-OSS): query (1, H, t, D), key/value
    (1, H_kv, t, D), sinks (H,), mask (1, 1, t, t) bool or None (causal) -> (1, t, H, D).

    softmax over [the row's scores, sink]; the sink's share is dropped, so each row's weights sum to < 1.
    The max is subtracted first (over the sink too), as transformers' eager GPT-OSS attention does."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling  # (1, H, t, t)
    t = query.shape[2]
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    combined = torch.cat(
        [scores, sinks.reshape(1, -1, 1, 1).expand(1, -1, t, 1).to(scores.dtype)], dim=-1
    )
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def _per_sequence(
    module, query, key, value, position_ids, dropout, scaling, sliding_window, sinks=None
) -> torch.Tensor:
    """query (B, H, T, D), key/value (B, H_kv, T, D) -> (B, T, H, D): causal sdpa per sequence of the row."""
    # rows must share one layout (e.g. unpacked)
    if position_ids is not None and position_ids.shape[0] > 1:
        if not torch.equal(position_ids, position_ids[:1].expand_as(position_ids)):
            raise ValueError(
                f"{NAME}: rows of a batch packed differently; pack into one row per micro-batch"
            )
        position_ids = position_ids[:1]
    bounds = [(0, query.shape[2])] if position_ids is None else sequence_bounds(position_ids)
    # split, not slicing: the backward of a split is one cat, that of each slice a zero-filled (1, H, T, D)
    lengths = [e - s for s, e in bounds]
    outs = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value))):
        mask = _window_mask(q.shape[2], sliding_window, q.device)
        if sinks is not None:
            if dropout:
                raise ValueError(
                    f"{NAME}: attention dropout with sinks is not implemented (set attention_dropout=0)"
                )
            outs.append(sink_attention(q, k, v, sinks, scaling, mask))
            continue
        out, _ = sdpa_attention_forward(
            module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=True
        )
        outs.append(out)  # (1, t, H, D)
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


AttentionInterface.register(NAME, packed_sdpa_attention_forward)
