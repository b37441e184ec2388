"""RolloutBatch samples -> one packed micro-batch of model inputs and per-token RL targets.

Several sequences share one row (no padding to the longest sequence); a block-diagonal causal
mask and per-sequence positions keep them independent. In a row, the token at position t is
predicted by the logits at t-1, so a sample's response tokens [s+P, s+L) are scored at the
"prediction positions" [s+P-1, s+L-1); every per-token field below lives on those positions.

    mb = build_micro_batch(batch, [3, 0, 7])
    mb["tokens"]          (1, T) int64     mb["position_ids"]  (1, T)
    mb["attention_mask"]  (1, 1, T, T) bool, True = may not attend (CPU path; TE uses cu_seqlens)
    mb["labels"]          (T,) next token at each position (0 where unused)
    mb["loss_mask"]       (T,) float, response_mask on prediction positions, else 0
    mb["seq_ids"]         (T,) int64, index into mb["indices"] (0 on padding, which is masked)
    mb["advantages"|"old_logprobs"|"ref_logprobs"|"rollout_logprobs"]  (T,) when the batch has them
"""
from __future__ import annotations

import torch

from rlmega.data.packing import block_causal_mask, pack
from rlmega.data.rollout_batch import RolloutBatch

_PER_TOKEN = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def build_micro_batch(batch: RolloutBatch, indices: list[int], row_multiple: int = 1,
                      dense_mask: bool = True) -> dict:
    packed = pack([batch.tokens[i] for i in indices], row_multiple=row_multiple)
    tokens, cu = packed["tokens"], packed["cu_seqlens"].tolist()
    T = tokens.shape[1]
    labels = torch.zeros(T, dtype=torch.int64)
    loss_mask = torch.zeros(T, dtype=torch.float32)
    seq_ids = torch.zeros(T, dtype=torch.int64)
    fields = {k: torch.zeros(T, dtype=torch.float32) for k in _PER_TOKEN if getattr(batch, k) is not None}
    response_positions = []
    for j, i in enumerate(indices):
        s, e, p = cu[j], cu[j + 1], int(batch.prompt_lens[i])
        labels[s:e - 1] = tokens[0, s + 1:e]
        seq_ids[s:e] = j
        pos = slice(s + p - 1, e - 1)  # positions that predict the response tokens
        loss_mask[pos] = batch.response_mask[i]
        for k, buf in fields.items():
            buf[pos] = getattr(batch, k)[i]
        response_positions.append((s + p - 1, e - 1))
    mb = {
        "tokens": tokens, "position_ids": packed["position_ids"], "labels": labels,
        "loss_mask": loss_mask, "seq_ids": seq_ids, "num_seqs": len(indices),
        "cu_seqlens": packed["cu_seqlens"], "max_seqlen": packed["max_seqlen"],
        "indices": list(indices), "response_positions": response_positions, **fields,
    }
    if dense_mask:
        mb["attention_mask"] = block_causal_mask(packed["cu_seqlens"], T)
    return mb


def scatter_responses(per_token: torch.Tensor, mb: dict) -> dict[int, torch.Tensor]:
    """Per-token values on prediction positions (T,) -> {sample index: (response_len,)}."""
    return {i: per_token[a:b] for i, (a, b) in zip(mb["indices"], mb["response_positions"])}
