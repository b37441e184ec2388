"""RolloutBatch samples -> one packed micro-batch of model inputs and per-token RL targets.

Several sequences share one row (no padding to the longest sequence); a block-diagonal causal
mask and per-sequence positions keep them independent. In a row, the token at position t is
predicted by the logits at t-1, so a sample's response tokens [s+P, s+L) are scored at the
"prediction positions" [s+P-1, s+L-1); every per-token field below lives on those positions.

With the dense mask (CPU, no Transformer Engine) a micro-batch is B rows of S tokens, each row no
longer than its longest sample (``packing.split_rows``: attention cost grows with the square of
a row); with THD packing (Transformer Engine) it is one row, B = 1. Per-token fields are flat over
the rows, row-major: position t of row r is index r * S + t, as ``logits.flatten(0, 1)`` orders them.

    mb = build_micro_batch(batch, [3, 0, 7])
    mb["tokens"]          (B, S) int64     mb["position_ids"]  (B, S)
    mb["attention_mask"]  (B, 1, S, S) bool, True = may not attend (CPU path; TE uses cu_seqlens)
    mb["labels"]          (B*S,) next token at each position (0 where unused)
    mb["loss_mask"]       (B*S,) float, response_mask on prediction positions, else 0
    mb["seq_ids"]         (B*S,) int64, index into mb["indices"] (0 on padding, which is masked)
    mb["advantages"|"old_logprobs"|"ref_logprobs"|"rollout_logprobs"]  (B*S,) when the batch has them
"""
from __future__ import annotations

import torch

from rlmega.data.packing import block_causal_mask, pack, placeholder_sample, split_rows
from rlmega.data.rollout_batch import RolloutBatch

_PER_TOKEN = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def build_micro_batch(batch: RolloutBatch, indices: list[int], row_multiple: int = 1,
                      dense_mask: bool = True) -> dict:
    """``dense_mask``: rows of the longest sample's length and their block-causal masks;
    False: one THD row (``cu_seqlens``, ``max_seqlen``) for Transformer Engine.

    Empty ``indices``: a placeholder (packing.plan_micro_batches with allow_empty) for a data-parallel
    rank with no sample of its own: the shortest sample's tokens with a zero loss mask and no
    ``indices``, so its loss, counts and statistics are 0 and no result is scattered from it, while its
    forward and backward take part in the schedule's collectives like any micro-batch.
    """
    if not indices:
        mb = build_micro_batch(batch, [placeholder_sample(batch.lengths())], row_multiple, dense_mask)
        mb["loss_mask"] = torch.zeros_like(mb["loss_mask"])
        mb["indices"], mb["response_positions"] = [], []
        return mb
    lengths = {i: int(batch.tokens[i].numel()) for i in indices}
    rows = split_rows(list(indices), lengths) if dense_mask else [list(indices)]
    packed = [pack([batch.tokens[i] for i in row], row_multiple=row_multiple) for row in rows]
    S = max(p["tokens"].shape[1] for p in packed)  # rows are padded to the longest (a multiple of row_multiple)
    B, order = len(rows), [i for row in rows for i in row]
    tokens = torch.zeros(B, S, dtype=torch.int64)
    position_ids = torch.zeros(B, S, dtype=torch.int64)
    labels = torch.zeros(B * S, dtype=torch.int64)
    loss_mask = torch.zeros(B * S, dtype=torch.float32)
    seq_ids = torch.zeros(B * S, dtype=torch.int64)
    fields = {k: torch.zeros(B * S, dtype=torch.float32) for k in _PER_TOKEN if getattr(batch, k) is not None}
    response_positions = []
    j = 0  # index into order
    for r, (row, p) in enumerate(zip(rows, packed)):
        T = p["tokens"].shape[1]
        tokens[r, :T], position_ids[r, :T] = p["tokens"][0], p["position_ids"][0]
        cu = p["cu_seqlens"].tolist()
        for k, i in enumerate(row):
            s, e, plen = r * S + cu[k], r * S + cu[k + 1], int(batch.prompt_lens[i])
            labels[s:e - 1] = tokens.view(-1)[s + 1:e]
            seq_ids[s:e] = j
            pos = slice(s + plen - 1, e - 1)  # positions that predict the response tokens
            loss_mask[pos] = batch.response_mask[i]
            for key, buf in fields.items():
                buf[pos] = getattr(batch, key)[i]
            response_positions.append((s + plen - 1, e - 1))
            j += 1
    mb = {
        "tokens": tokens, "position_ids": position_ids, "labels": labels,
        "loss_mask": loss_mask, "seq_ids": seq_ids, "num_seqs": len(order),
        "indices": order, "response_positions": response_positions, **fields,
    }
    if dense_mask:
        # rows shorter than S: their tail is padding, which block_causal_mask lets see only itself
        mb["attention_mask"] = torch.cat([block_causal_mask(p["cu_seqlens"], S) for p in packed])
    else:
        mb["cu_seqlens"], mb["max_seqlen"] = packed[0]["cu_seqlens"], packed[0]["max_seqlen"]
    return mb


def scatter_responses(per_token: torch.Tensor, mb: dict) -> dict[int, torch.Tensor]:
    """Per-token values on prediction positions (B*S,) -> {sample index: (response_len,)}."""
    return {i: per_token[a:b] for i, (a, b) in zip(mb["indices"], mb["response_positions"])}
