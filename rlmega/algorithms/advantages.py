"""Sequence-level advantage estimators for outcome rewards (one scalar reward per sample).

Every estimator maps `rewards: (N,)` float and `group_ids: (N,)` int64 to advantages `(N,)` in the
rewards' float dtype. Group statistics are always computed in float64 and a group whose rewards are
all equal (max == min) gets advantage exactly 0 under every estimator: it carries no signal.
Samples that share a group id answer the same prompt; ids need not be contiguous or sorted.
`to_tokens` then spreads one advantage per sequence over that sequence's response tokens.

Pure functions: tensors and scalars in, tensors out; no config objects, no process groups.
"""

import math
from typing import Tuple

import torch

ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce_plus_plus")


def _group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample view of group statistics, all (N,): group size, group mean, group sum of squared
    deviations, and whether the sample's group carries signal (>= 2 members that are not all equal).

    Deviations are summed around the mean (two passes) rather than via E[r^2] - E[r]^2, which cancels
    catastrophically when rewards are large and nearly equal. Even so the mean of n equal values is
    not always that value in floating point (sum then divide rounds twice), so "all equal" is decided
    exactly, by comparing the group's max with its min, never from a tiny std.
    """
    # unique(return_inverse) renumbers arbitrary ids to 0..G-1 so index_add_ can use them as slots.
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (N,) in [0, G)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )  # (G,)
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)  # (G,)
    mean = (total / count)[inverse]  # (N,)
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (rewards - mean) ** 2)[inverse]  # (N,)
    # (N,)
    g_max = torch.full_like(count, -math.inf).scatter_reduce(0, inverse, rewards, "amax")[inverse]
    # (N,)
    g_min = torch.full_like(count, math.inf).scatter_reduce(0, inverse, rewards, "amin")[inverse]
    informative = (count[inverse] > 1) & (g_max > g_min)
    return count[inverse], mean, sq_dev, informative


def _as_float64(rewards: torch.Tensor) -> torch.Tensor:
    """Group statistics are computed in float64 whatever the input: in float32 the rounding of a
    group mean (one ulp, ~1e-8 relative) is a visible fraction of a small std, and integer rewards
    (0/1 correctness) would make every mean round down to 0."""
    return rewards.to(torch.float64)


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    """The input's float dtype; integer rewards give float32."""
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _grpo64(
    r: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool, eps: float
) -> torch.Tensor:
    """grpo on float64 rewards (N,) -> float64 advantages (N,), exactly 0 for groups without signal."""
    count, mean, sq_dev, informative = _group_stats(r, group_ids)
    centered = r - mean  # (N,)
    if norm_by_std:
        # clamp only avoids 0/0 for singletons; their value is replaced by 0 just below.
        std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))  # (N,)
        centered = centered / (std + eps)
    return torch.where(informative, centered, torch.zeros_like(centered))


def grpo(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std.

    rewards: (N,) float or int, group_ids: (N,) int64 -> advantages: (N,) in the rewards' float dtype
    (float32 for integer rewards), computed in float64 and rounded once.
    std_g is the UNBIASED (Bessel-corrected, divide by n-1) group std, as torch.std in verl and
    DeepSeek's GRPO. A group of one sample has no baseline (its mean is itself and its unbiased
    std is undefined), so it gets advantage 0. A group whose rewards are all equal (max == min) gets
    exactly 0: without that, float rounding of the mean divided by std ~1e-7 + eps gave such groups
    same-signed advantages up to ~0.6 in float32 (a biased push, not noise).
    """
    return _grpo64(_as_float64(rewards), group_ids, norm_by_std, eps).to(_out_dtype(rewards))


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the OTHER samples of the group.

    rewards: (N,) float or int, group_ids: (N,) int64 -> advantages: (N,) in the rewards' float dtype,
    computed in float64. Leave-one-out keeps the baseline independent of the sample it scores, so
    the estimate is unbiased. Algebraically r_i - (sum_g - r_i)/(n-1) = n/(n-1) * (r_i - mean_g).
    A group of one has no other sample to compare with, and a group of equal rewards has nothing to
    compare: both get exactly 0.
    """
    r = _as_float64(rewards)
    count, mean, _, informative = _group_stats(r, group_ids)
    others_mean = (count * mean - r) / (count - 1).clamp(min=1)  # (N,)
    adv = torch.where(informative, r - others_mean, torch.zeros_like(r))
    return adv.to(_out_dtype(rewards))


def reinforce_plus_plus(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, as in OpenRLHF `reinforce_baseline`).

    rewards: (N,) float or int, group_ids: (N,) int64 -> advantages: (N,) in the rewards' float dtype,
    computed in float64.
    Step 1 subtracts the group mean (the prompt's baseline; no per-group std, which GRPO uses and which
    blows up near-unanimous groups); singletons and unanimous groups get exactly 0. Step 2 whitens
    over the WHOLE batch: subtract the batch mean and divide by the batch population std (divide by
    N), like OpenRLHF's whitening. After step 1 every group sums to 0, so the batch mean is 0 up to
    float64 rounding; re-centering is kept so the output has mean 0 and std 1 as the paper writes it,
    and the samples that step 1 zeroed are zeroed again afterwards: the re-centering would otherwise
    hand them the (rounding-noise) batch mean, and whitening would scale it into a push.
    OpenRLHF whitens over tokens, weighting long responses more; this whitens over samples, so every
    sample counts once.
    """
    r = _as_float64(rewards)
    informative = _group_stats(r, group_ids)[3]  # (N,)
    # (N,) r - group mean, 0 without signal
    centered = _grpo64(r, group_ids, norm_by_std=False, eps=eps)
    centered = centered - centered.mean()
    whitened = centered / (centered.std(unbiased=False) + eps)
    return torch.where(informative, whitened, torch.zeros_like(whitened)).to(_out_dtype(rewards))


def compute(name: str, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dispatch by estimator name: "grpo" | "grpo_no_std" | "rloo" | "reinforce_plus_plus".

    rewards: (N,) float, group_ids: (N,) int64 -> advantages: (N,). Default eps everywhere.
    """
    if name == "grpo":
        return grpo(rewards, group_ids, norm_by_std=True)
    if name == "grpo_no_std":
        return grpo(rewards, group_ids, norm_by_std=False)
    if name == "rloo":
        return rloo(rewards, group_ids)
    if name == "reinforce_plus_plus":
        return reinforce_plus_plus(rewards, group_ids)
    raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ESTIMATORS)}")


def to_tokens(seq_adv: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages to the tokens of a packed micro-batch.

    seq_adv: (S,), seq_ids: (T,) int64 in [0, S) on masked tokens, mask: (T,) float -> (T,), 0 where mask is 0.
    Tokens with mask 0 (prompt, padding) may carry any seq id, even one out of range, so they are
    pointed at slot 0 before indexing and zeroed after.
    """
    valid = mask > 0  # (T,)
    if seq_adv.numel() == 0:
        return torch.zeros(mask.shape, dtype=seq_adv.dtype, device=mask.device)
    safe_ids = torch.where(valid, seq_ids, torch.zeros_like(seq_ids))  # (T,)
    per_token = seq_adv[safe_ids]  # (T,)
    return torch.where(valid, per_token, torch.zeros_like(per_token))
