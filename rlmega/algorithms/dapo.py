"""DAPO's batch shaping (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at
scale", sec. 3.2 and 3.4): dynamic sampling and overlong reward shaping.

  dynamic sampling   a group whose rewards are all equal has advantage 0 for every sample under GRPO,
                     so it adds no gradient but dilutes the batch; such groups are dropped and the
                     batch refilled with other prompts (the producer does the refilling).
  overlong penalty   a response cut at the budget L_max is not necessarily wrong, so instead of the
                     cliff of a truncated answer the reward gets a soft length penalty over the last
                     L_cache tokens of the budget (their eq. 13):
                         R(y) = 0                                   |y| <= L_max - L_cache
                                ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                                -1                                  L_max < |y|
                     scaled by a factor (DAPO: 1.0).

Pure functions: tensors and numbers in, tensors out.
"""

from __future__ import annotations

from typing import Sequence

import torch


def is_uniform(rewards: Sequence[float]) -> bool:
    """One group's rewards (n,) as numbers: all equal (exactly: rewards are judged, not computed)."""
    return len(set(float(r) for r in rewards)) <= 1


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """lengths (B,) response tokens -> (B,) float32 penalty in [-factor, 0] (DAPO eq. 13 x factor).

    ``max_len``: the budget L_max; ``buffer``: L_cache, 1 <= buffer <= max_len. A length past the budget
    (a tool result may overshoot a turn's count) gets the full -factor.
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_len={max_len}]")
    start = max_len - buffer  # lengths up to here are not penalised
    x = lengths.to(torch.float32)
    ramp = (start - x) / buffer  # 0 at start, -1 at max_len
    return factor * ramp.clamp(min=-1.0, max=0.0)


def default_buffer(max_len: int) -> int:
    """DAPO's proportion: L_cache = 4096 of L_max = 20480, a fifth (at least one token)."""
    return max(1, max_len // 5)
