"""Token-budget micro-batching and sequence packing (pure torch/python, no process groups).

    plan = plan_micro_batches(batch.lengths(), max_tokens=8192, dp_size=2, multiple_of=pp)
    for idx in plan[dp_rank]:                      # one micro-batch = one packed row
        row = pack([batch.tokens[i] for i in idx], row_multiple=tp)
        ...  logits = model(row["tokens"], row["position_ids"], packed_seq_params(row["cu_seqlens"]))
        per_seq = unpack(token_logprobs, row["cu_seqlens"])

A packed row holds S sequences back to back, then right padding: ``[a a | b b b | pad]``.
Attention must stay inside each sequence: Transformer Engine reads ``cu_seqlens`` (THD format), the
local spec's and FSDP's SDPA run once per sequence, so one long row costs nothing extra.
``block_causal_mask`` is the dense (T, T) equivalent, the reference the tests check them against.
"""

from __future__ import annotations

import heapq

import torch


def mini_batch_count(num_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in an RL step of ``num_samples`` samples: the whole global batches it holds, at
    least one (a short batch, after stale drops or short dynamic sampling, still trains once).

    The one place this is computed: the LR schedule's length (rlmega.launch.roles, with the nominal
    trainer.prompts_per_step x rollout.n samples) and the step's split (rlmega.step, with the batch's
    own size) both call it, so a full batch gives both the same count.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    return max(1, int(num_samples) // global_batch_size)


def plan_micro_batches(
    lengths: list[int],
    max_tokens: int,
    dp_size: int = 1,
    multiple_of: int = 1,
    allow_empty: bool = False,
) -> list[list[list[int]]]:
    """plan[rank][mb] = ascending sample indices of one micro-batch of data-parallel ``rank``.

    1. Balance samples across DP ranks by tokens: longest first, each to the rank with the fewest
       tokens so far (ties: lowest rank).
    2. Within a rank, first-fit-decreasing into micro-batches of at most ``max_tokens`` tokens.
    3. Split micro-batches (most samples first) until each rank has a multiple of ``multiple_of``
       (Megatron's interleaved pipeline schedule needs num_microbatches % PP == 0).
    Deterministic: equal inputs give equal plans on every rank, so no rank needs to broadcast it.

    ``allow_empty``: a rank with too few samples (fewer samples than ranks, or than ``multiple_of``
    micro-batches) gets empty micro-batches ``[]`` after its real ones instead of an error. An empty
    micro-batch is a placeholder: the trainer runs it with a zero loss mask (``placeholder_sample``'s
    tokens), so the rank contributes nothing but still takes part in every collective of the step.
    Config validation makes a full batch never need one; a short batch (stale drops, short dynamic
    sampling) may.
    """
    if max_tokens < 1 or dp_size < 1 or multiple_of < 1:
        raise ValueError(
            f"max_tokens, dp_size and multiple_of must be >= 1, got {max_tokens}, {dp_size}, {multiple_of}"
        )
    lengths = [int(x) for x in lengths]
    if not lengths:
        raise ValueError("no samples to plan: a batch needs at least one sample")
    if dp_size > len(lengths) and not allow_empty:
        raise ValueError(
            f"dp_size={dp_size} ranks but only {len(lengths)} samples: every rank needs at least one; "
            "fix: generate more samples per step or use fewer data-parallel ranks"
        )
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(
                f"sample {i} has length {length}; every sample needs at least one token"
            )
        if length > max_tokens:
            raise ValueError(
                f"sample {i} has {length} tokens, more than max_tokens={max_tokens} per micro-batch; "
                f"fix: raise the token budget to at least {length} (or cap prompt + response length)"
            )

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    # heap of (tokens so far, rank): ties -> lowest rank
    loads = [(0, rank) for rank in range(dp_size)]
    for i in order:
        load, rank = heapq.heappop(loads)
        per_rank[rank].append(i)  # stays longest-first, as FFD wants
        heapq.heappush(loads, (load + lengths[i], rank))

    plan = []
    for rank, samples in enumerate(per_rank):
        bins = _first_fit_decreasing(samples, lengths, max_tokens)
        # at least one micro-batch: a rank without samples still runs the schedule (allow_empty)
        target = max(1, -(-len(bins) // multiple_of)) * multiple_of
        if target > len(samples) and not allow_empty:
            raise ValueError(
                f"DP rank {rank} has {len(samples)} samples in {len(bins)} micro-batches, but multiple_of="
                f"{multiple_of} needs {target} micro-batches of at least one sample each; fix: generate more "
                "samples per step, use fewer data-parallel ranks, or lower the pipeline size (multiple_of)"
            )
        while len(bins) < target and any(len(b) > 1 for b in bins):
            bins = _split_fullest(bins, lengths)
        plan.append([sorted(b) for b in bins] + [[] for _ in range(target - len(bins))])
    return plan


def placeholder_sample(lengths: list[int]) -> int:
    """The sample whose tokens an empty micro-batch runs (masked out): the shortest, ties the lowest index."""
    return min(range(len(lengths)), key=lambda i: (int(lengths[i]), i))


def _first_fit_decreasing(samples: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sample indices; ``samples`` must already be longest-first (ties: lowest index)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in samples:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _split_fullest(bins: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Replace the bin with the most samples (ties: first) by two token-balanced halves."""
    b = max(range(len(bins)), key=lambda k: (len(bins[k]), -k))
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(bins[b], key=lambda i: (-lengths[i], i)):
        # Lighter half, ties to the first; lengths >= 1, so the two longest seed one half each.
        h = 1 if loads[1] < loads[0] else 0
        halves[h].append(i)
        loads[h] += lengths[i]
    return bins[:b] + halves + bins[b + 1 :]


def padding_efficiency(
    lengths: list[int], plan: list[list[list[int]]], row_multiple: int = 1
) -> float:
    """Real tokens / computed tokens of a plan.

    A micro-batch is one row padded up to ``row_multiple``; an empty one (a placeholder) computes the
    shortest sample's row and counts no real token.
    """
    real = computed = 0
    for rank in plan:
        for mb in rank:
            if not mb:  # a placeholder computes the shortest sample's row, all of it padding
                computed += -(-min(lengths) // row_multiple) * row_multiple
                continue
            real += sum(lengths[i] for i in mb)
            computed += -(-sum(lengths[i] for i in mb) // row_multiple) * row_multiple
    return real / computed if computed else 1.0


def pack(seqs: list[torch.Tensor], row_multiple: int = 1, pad_id: int = 0) -> dict:
    """Concatenate 1-D token tensors into one right-padded row (T = total rounded up to row_multiple).

    Returns ``tokens`` (1, T) int64, ``position_ids`` (1, T) int64 (restart at 0 per sequence,
    0 on padding), ``seq_ids`` (T,) int64 (-1 on padding), ``cu_seqlens`` (S+1,) int32 (padding
    excluded, TE's THD format), ``max_seqlen`` int and ``num_real`` int (tokens before padding).
    """
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    for i, s in enumerate(seqs):
        if s.dim() != 1:
            raise ValueError(f"seqs[{i}] must be 1-D, got shape {tuple(s.shape)}")
    seq_lens = [int(s.numel()) for s in seqs]
    num_real = sum(seq_lens)
    total = -(-num_real // row_multiple) * row_multiple
    pad = total - num_real

    tokens = torch.full((total,), pad_id, dtype=torch.int64)
    if seqs:
        tokens[:num_real] = torch.cat([s.to(torch.int64) for s in seqs])
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    seq_ids = torch.cat(
        [torch.repeat_interleave(torch.arange(len(seqs)), lens), torch.full((pad,), -1)]
    )
    starts = torch.cumsum(lens, 0) - lens  # (S,) first position of each sequence
    position_ids = torch.zeros(total, dtype=torch.int64)
    position_ids[:num_real] = torch.arange(num_real) - torch.repeat_interleave(starts, lens)
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lens, 0)
    return {
        "tokens": tokens.unsqueeze(0),  # (1, T)
        "position_ids": position_ids.unsqueeze(0),  # (1, T)
        "seq_ids": seq_ids.to(torch.int64),  # (T,)
        "cu_seqlens": cu_seqlens,  # (S+1,)
        "max_seqlen": max(seq_lens, default=0),
        "num_real": num_real,
    }


def block_causal_mask(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """(1, 1, T, T) bool, True = may NOT attend (Megatron's convention).

    A token sees earlier-or-same positions of its own sequence; a padding token sees only itself,
    so no softmax row is empty (an all-masked row would give NaN). Dense O(T^2): the reference of the
    tests; the trainers attend per sequence from ``cu_seqlens``.
    """
    seq_ids = _seq_ids(cu_seqlens, total_len)  # (T,)
    pos = torch.arange(total_len)
    allowed = (
        (seq_ids[:, None] == seq_ids[None, :])
        & (pos[None, :] <= pos[:, None])
        & (seq_ids[:, None] >= 0)
    )
    allowed |= torch.eye(total_len, dtype=torch.bool)
    return (~allowed)[None, None]


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of ``pack``'s concatenation: (T,) or (1, T) -> per-sequence views; padding dropped."""
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]
    if values.dim() != 1:
        raise ValueError(f"unpack: values must be (T,) or (1, T), got shape {tuple(values.shape)}")
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if bounds and bounds[-1] > values.numel():
        raise ValueError(
            f"unpack: cu_seqlens ends at {bounds[-1]} but values has only {values.numel()} entries"
        )
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _seq_ids(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """(T,) int64 sequence index per position, -1 past cu_seqlens[-1]."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if (
        not bounds
        or bounds[0] != 0
        or any(b < a for a, b in zip(bounds, bounds[1:]))
        or bounds[-1] > total_len
    ):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end <= total_len={total_len}, got {bounds}"
        )
    lens = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return torch.cat([ids, torch.full((total_len - bounds[-1],), -1, dtype=torch.int64)])
