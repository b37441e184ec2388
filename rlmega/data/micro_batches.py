"""RolloutBatch samples -> one packed micro-batch of model inputs and per-token RL targets.

Several sequences share one row (no padding to the longest sequence); attention causal within each
sequence (its offsets in ``row_cu`` / ``cu_seqlens``) and per-sequence positions keep them independent.
In a row, the token at position t is predicted by the logits at t-1, so a sample's response tokens
[s+P, s+L) are scored at the "prediction positions" [s+P-1, s+L-1); every per-token field below lives
on those positions.

A micro-batch is one packed row (B = 1; attention per sequence: Transformer Engine's THD, Megatron's
local spec through rlmega.megatron.packed_attention, FSDP through rlmega.fsdp.packed_attention), or B
rows when ``min_shape`` adds rows of padding (expert-parallel ranks that must run equal shapes).
Per-token fields are flat over the rows, row-major: position t of row r is index r * S + t, as
``logits.flatten(0, 1)`` orders them.

    mb = build_micro_batch(batch, [3, 0, 7])
    mb["tokens"]          (B, S) int64     mb["position_ids"]  (B, S)
    mb["cu_seqlens"], mb["max_seqlen"]  the first row's sequence offsets (int32) and longest sequence
    mb["labels"]          (B*S,) next token at each position (0 where unused)
    mb["loss_mask"]       (B*S,) float, response_mask on prediction positions, else 0
    mb["seq_ids"]         (B*S,) int64, index into mb["indices"] (0 on padding, which is masked)
    mb["advantages"|"old_logprobs"|"ref_logprobs"|"rollout_logprobs"|"returns"|"old_values"]
                          (B*S,) when the batch has them
    mb["rows"], mb["row_cu"]  the sample indices of each row and their offsets in it (len + 1 each)
    mb["real_tokens"]     (B*S,) bool, False on padding;  mb["generated"] (B*S,) bool, the response tokens
    mb["routed_experts"]  (B, S, M, K) int16 when the batch has routes (-1 on padding and where the batch has -1)
    mb["vision"]          when the batch has images: each sequence's processor outputs (or None), in row order;
    mb["prompt_ends"]     then also where each sequence's prompt ends in the row (its first response position)
"""

from __future__ import annotations

import torch

from rlmega.data.packing import pack, placeholder_sample
from rlmega.data.rollout_batch import RolloutBatch

_PER_TOKEN = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "returns",
    "old_values",
)


def build_micro_batch(
    batch: RolloutBatch,
    indices: list[int],
    row_multiple: int = 1,
    min_shape: tuple[int, int] | None = None,
) -> dict:
    """The samples ``indices`` packed into one row (their offsets in ``row_cu[0]`` and ``cu_seqlens``).

    ``min_shape`` (B, S): at least B rows of at least S tokens, the extra all padding. Megatron's
    allgather MoE token dispatcher gathers equal-sized token blocks over the expert-parallel group, so
    expert-parallel ranks must run micro-batches of one shape (``micro_batch_shape`` gives each rank's,
    the caller takes the max).

    Empty ``indices``: a placeholder (packing.plan_micro_batches with allow_empty) for a data-parallel
    rank with no sample of its own: the shortest sample's tokens with a zero loss mask and no
    ``indices``, so its loss, counts and statistics are 0 and no result is scattered from it, while its
    forward and backward take part in the schedule's collectives like any micro-batch.
    """
    if not indices:
        mb = build_micro_batch(
            batch, [placeholder_sample(batch.lengths())], row_multiple, min_shape
        )
        mb["loss_mask"] = torch.zeros_like(mb["loss_mask"])
        mb["indices"], mb["response_positions"], mb["rows"] = [], [], []
        mb["real_tokens"], mb["generated"] = (
            torch.zeros_like(mb["real_tokens"]),
            torch.zeros_like(mb["generated"]),
        )
        return mb
    rows = [list(indices)]  # one row: attention is per sequence, so a long row costs nothing extra
    packed = [pack([batch.tokens[i] for i in row], row_multiple=row_multiple) for row in rows]
    # rows are padded to the longest (a multiple of row_multiple)
    S = max(p["tokens"].shape[1] for p in packed)
    B, order = len(rows), [i for row in rows for i in row]
    if min_shape is not None:
        B, S = max(B, min_shape[0]), max(S, min_shape[1])
    tokens = torch.zeros(B, S, dtype=torch.int64)
    position_ids = torch.zeros(B, S, dtype=torch.int64)
    labels = torch.zeros(B * S, dtype=torch.int64)
    loss_mask = torch.zeros(B * S, dtype=torch.float32)
    seq_ids = torch.zeros(B * S, dtype=torch.int64)
    fields = {
        k: torch.zeros(B * S, dtype=torch.float32)
        for k in _PER_TOKEN
        if getattr(batch, k) is not None
    }
    real_tokens = torch.zeros(B * S, dtype=torch.bool)
    generated = torch.zeros(B * S, dtype=torch.bool)
    row_cu = []
    response_positions = []
    j = 0  # index into order
    for r, (row, p) in enumerate(zip(rows, packed)):
        T = p["tokens"].shape[1]
        tokens[r, :T], position_ids[r, :T] = p["tokens"][0], p["position_ids"][0]
        cu = p["cu_seqlens"].tolist()
        row_cu.append(cu)
        for k, i in enumerate(row):
            s, e, plen = r * S + cu[k], r * S + cu[k + 1], int(batch.prompt_lens[i])
            labels[s : e - 1] = tokens.view(-1)[s + 1 : e]
            seq_ids[s:e] = j
            pos = slice(s + plen - 1, e - 1)  # positions that predict the response tokens
            loss_mask[pos] = batch.response_mask[i]
            for key, buf in fields.items():
                buf[pos] = getattr(batch, key)[i]
            response_positions.append((s + plen - 1, e - 1))
            real_tokens[s:e] = True
            generated[s + plen : e] = True
            j += 1
    mb = {
        "tokens": tokens,
        "position_ids": position_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "seq_ids": seq_ids,
        "num_seqs": len(order),
        "indices": order,
        "response_positions": response_positions,
        **fields,
        "rows": rows,
        "row_cu": row_cu,
        "real_tokens": real_tokens,
        "generated": generated,
    }
    if batch.routed_experts is not None:
        mb["routed_experts"] = pack_routes(batch.routed_experts, rows, row_cu, B, S)
    # each sequence's images, in row order (rlmega/fsdp/vision_inputs.py)
    if batch.vision is not None:
        mb["vision"] = [batch.vision[i] for i in order]
        # where each sequence's prompt ends in the row: image placeholders after it are sampled text
        mb["prompt_ends"] = [s + int(batch.prompt_lens[i]) for i, s in zip(order, row_cu[0][:-1])]
    mb["cu_seqlens"], mb["max_seqlen"] = packed[0]["cu_seqlens"], packed[0]["max_seqlen"]
    return mb


def micro_batch_shape(
    lengths: list[int], indices: list[int], row_multiple: int = 1
) -> tuple[int, int]:
    """(B, S) of ``build_micro_batch(batch, indices, row_multiple)``, from lengths only: one row."""
    if not indices:
        indices = [placeholder_sample(lengths)]
    return 1, -(-sum(lengths[i] for i in indices) // row_multiple) * row_multiple


def pack_routes(
    routes: list[torch.Tensor], rows: list[list[int]], row_cu: list[list[int]], B: int, S: int
) -> torch.Tensor:
    """Per-sample routes (L_i, M, K) int16 -> the micro-batch's rows (B, S, M, K) int16, -1 on padding.

    rows[r]: the samples of row r, at offsets row_cu[r] (len(rows[r]) + 1 of them).
    """
    M, K = routes[rows[0][0]].shape[1:]
    out = torch.full((B, S, M, K), -1, dtype=torch.int16)
    for r, (row, cu) in enumerate(zip(rows, row_cu)):
        for k, i in enumerate(row):
            out[r, cu[k] : cu[k + 1]] = routes[i]
    return out


def unpack_rows(rows_values: torch.Tensor, mb: dict) -> dict[int, torch.Tensor]:
    """Inverse of ``pack_routes`` for any (B, S, ...) tensor: {sample index: (L_i, ...)}."""
    return {
        i: rows_values[r, cu[k] : cu[k + 1]]
        for r, (row, cu) in enumerate(zip(mb["rows"], mb["row_cu"]))
        for k, i in enumerate(row)
    }


def scatter_responses(per_token: torch.Tensor, mb: dict) -> dict[int, torch.Tensor]:
    """Per-token values on prediction positions (B*S,) -> {sample index: (response_len,)}."""
    return {i: per_token[a:b] for i, (a, b) in zip(mb["indices"], mb["response_positions"])}
