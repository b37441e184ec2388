"""Engine samples -> RolloutBatch (the trainer's batch contract)."""
from __future__ import annotations

from typing import Sequence

import torch

from rlmega.data.rollout_batch import RolloutBatch


def batch_from_samples(samples: Sequence, rewards: Sequence[float] | None = None,
                       group_offset: int = 0, sample_offset: int = 0) -> RolloutBatch:
    """Samples with prompt_index, prompt_ids, response_ids, logprobs (RolloutWorker.generate).

    Samples of one prompt share a group id (prompt_index + group_offset). A sample with an empty
    response is dropped: it has no token to score.
    """
    kept = [s for s in samples if len(s.response_ids) > 0]
    if rewards is not None:
        rewards = [r for s, r in zip(samples, rewards) if len(s.response_ids) > 0]
    tokens = [torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.int64) for s in kept]
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in kept], dtype=torch.int64),
        response_mask=[torch.ones(len(s.response_ids), dtype=torch.float32) for s in kept],
        rollout_logprobs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in kept],
        rewards=None if rewards is None else torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor([s.prompt_index + group_offset for s in kept], dtype=torch.int64),
        sample_ids=torch.arange(sample_offset, sample_offset + len(kept), dtype=torch.int64),
    )
