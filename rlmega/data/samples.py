"""Engine samples -> RolloutBatch (the trainer's batch contract)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from rlmega.data.rollout_batch import RolloutBatch


def batch_from_samples(
    samples: Sequence,
    rewards: Sequence[float] | None = None,
    group_offset: int = 0,
    sample_offset: int = 0,
    prompt_vision: Sequence[dict | None] | None = None,
) -> RolloutBatch:
    """Samples with prompt_index, prompt_ids, response_ids, logprobs (RolloutWorker.generate).

    ``prompt_vision``: a vision-language model's processor outputs of each prompt (by prompt_index; None for a
    prompt without images), which the batch's ``vision`` gives each sample of that prompt.

    Samples of one prompt share a group id (prompt_index + group_offset). A sample with an empty
    response is dropped: it has no token to score. Samples with ``routed_experts`` (a RolloutWorker
    started with record_routes) give the batch's ``routed_experts`` (MoE routing replay).
    """
    kept = [s for s in samples if len(s.response_ids) > 0]
    if rewards is not None:
        rewards = [r for s, r in zip(samples, rewards) if len(s.response_ids) > 0]
    tokens = [
        torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.int64) for s in kept
    ]
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in kept], dtype=torch.int64),
        response_mask=[torch.ones(len(s.response_ids), dtype=torch.float32) for s in kept],
        rollout_logprobs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in kept],
        rewards=None if rewards is None else torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor([s.prompt_index + group_offset for s in kept], dtype=torch.int64),
        sample_ids=torch.arange(sample_offset, sample_offset + len(kept), dtype=torch.int64),
        routed_experts=routes_of(
            [getattr(s, "routed_experts", None) for s in kept],
            [len(s.prompt_ids) + len(s.response_ids) for s in kept],
        ),
        vision=None if prompt_vision is None else [prompt_vision[s.prompt_index] for s in kept],
    )


def routes_of(routes: Sequence, lengths: Sequence[int]) -> list[torch.Tensor] | None:
    """RolloutBatch.routed_experts from per-row routes (tensors or arrays, or None): None when no row has
    any; else each row as (length, layers, topk) int16, -1 rows padding a short one and filling a row
    that has none (the trainer routes those live and counts them)."""
    have = [r for r in routes if r is not None]
    if not have:
        return None
    shape = tuple(have[0].shape[1:])
    out = []
    for r, n in zip(routes, lengths):
        rows = torch.full((n, *shape), -1, dtype=torch.int16)
        if r is not None:
            # np.array copies: the engine's rows come from read-only bytes, which torch warns about
            r = r if isinstance(r, torch.Tensor) else torch.from_numpy(np.array(r, dtype=np.int16))
            rows[: min(len(r), n)] = r[:n]
        out.append(rows)
    return out
