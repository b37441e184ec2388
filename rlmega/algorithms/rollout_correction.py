"""Rollout correction: the rollout engine (vLLM) and the trainer (Megatron) compute log-probs of the
same policy differently (kernels, precision, batching), so the tokens were sampled from pi_rollout,
not from pi_old, the training policy the engine was supposed to be. These corrections reweight or
drop tokens by the mismatch ratio

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprobs_t - rollout_logprobs_t)

(old_logprobs: the trainer's log-probs before the update; no gradient flows through rho).

  tis        truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
             brings you off-policy RL training"; verl `rollout_is="token"` with `rollout_is_threshold`):
             the per-token policy-gradient loss is multiplied by w_t = min(rho_t, C).
  mis_token  masked importance sampling, token level (Liu, Li et al. 2025, "When speed kills stability";
             verl's rejection sampling `rollout_rs="token"`): tokens with rho_t outside [lo, hi] are dropped.
  mis_seq    masked IS, sequence level: a sequence is dropped whole when its ratio leaves [lo, hi]. The
             sequence ratio is the GEOMETRIC MEAN of its token ratios over the sequence's masked tokens,
             exp(mean_t log rho_t) (verl `rollout_rs="geometric"`), not their product: the product
             drifts exponentially with length, so one [lo, hi] could not serve short and long answers.
             The geometric mean averages the mismatch out, so its useful bounds are much tighter than
             a token's (verl documents 1.0001 - 1.001 as typical upper thresholds for it).

Dropped tokens leave the loss AND its denominators (as verl's `modified_response_mask`): the trainer
multiplies the loss mask by `keep`, so a batch with many dropped tokens is not diluted by zeros.

Shapes: every token tensor is (T,) over a packed micro-batch; `mask` (T,) float is 1.0 on response
tokens that count; `seq_ids` (T,) int64 in [0, num_seqs). Returned `stats` are per token, detached,
0 off the mask, so sum(stat) / sum(mask) is their mean over tokens:
    "ratio"      rho_t (for mis_seq too: the token ratio, so means compare across modes)
    "truncated"  1 where TIS capped the weight
    "masked"     1 where the token was dropped (for mis_seq: every token of a dropped sequence)

Pure functions: tensors and scalars in, tensors out; no config objects, no process groups.
"""

from typing import Dict, Tuple

import torch

MODES = ("none", "tis", "mis_token", "mis_seq")

# exp(+-20) bounds the ratio where a log-prob is -inf or absurdly far (a token the engine could not
# have sampled): such tokens are capped (tis) or dropped (mis) anyway, and exp() stays finite.
LOG_RATIO_CLAMP = 20.0

Stats = Dict[str, torch.Tensor]


def log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log rho_t = old - rollout, clamped to [-20, 20], 0 off the mask: (T,) x3 -> (T,), detached."""
    lr = (old_logprobs.detach() - rollout_logprobs.detach()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return torch.where(mask > 0, lr, torch.zeros_like(lr))


def _stats(
    ratio: torch.Tensor, truncated: torch.Tensor, masked: torch.Tensor, mask: torch.Tensor
) -> Stats:
    valid, zero = mask > 0, torch.zeros_like(ratio)
    return {
        "ratio": torch.where(valid, ratio, zero),
        "truncated": torch.where(valid & truncated, torch.ones_like(ratio), zero),
        "masked": torch.where(valid & masked, torch.ones_like(ratio), zero),
    }


def tis(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> Tuple[torch.Tensor, Stats]:
    """Truncated IS: (T,) x3, cap C >= 1 -> weights (T,) = min(rho_t, C) (0 off the mask), stats.

    The cap bounds the variance a token with a tiny pi_rollout would add; the weight multiplies the
    per-token policy-gradient loss and is detached (it corrects the sampling distribution, it is not
    optimised).
    """
    ratio = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask))  # (T,)
    truncated = ratio > cap
    weights = torch.where(mask > 0, ratio.clamp(max=cap), torch.zeros_like(ratio))
    return weights, _stats(ratio, truncated, torch.zeros_like(truncated), mask)


def mis_token(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> Tuple[torch.Tensor, Stats]:
    """Token-level masked IS: (T,) x3 -> keep (T,) float, 1 where low <= rho_t <= high (0 off the mask), stats."""
    ratio = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask))  # (T,)
    inside = (ratio >= low) & (ratio <= high)
    keep = torch.where((mask > 0) & inside, torch.ones_like(ratio), torch.zeros_like(ratio))
    return keep, _stats(ratio, torch.zeros_like(inside), ~inside, mask)


def sequence_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
) -> torch.Tensor:
    """Per sequence, the mean over its masked tokens of log rho_t -> (num_seqs,); 0 for a sequence
    without masked tokens. exp() of it is the geometric mean of the token ratios."""
    lr = log_ratio(old_logprobs, rollout_logprobs, mask)  # (T,), 0 off the mask
    valid = mask > 0
    ids = torch.where(valid, seq_ids, torch.zeros_like(seq_ids))  # off-mask ids may be out of range
    slots = max(num_seqs, 1)
    total = torch.zeros(slots, dtype=lr.dtype, device=lr.device).index_add(0, ids, lr)
    count = torch.zeros(slots, dtype=lr.dtype, device=lr.device).index_add(
        0, ids, valid.to(lr.dtype)
    )
    return (total / count.clamp(min=1.0))[:num_seqs]


def mis_seq(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    low: float = 0.5,
    high: float = 2.0,
) -> Tuple[torch.Tensor, Stats]:
    """Sequence-level masked IS: (T,) x3, seq_ids (T,), S -> keep (T,) float, stats.

    keep_t = 1 when the geometric-mean ratio of token t's sequence is in [low, high], else 0 (and 0
    off the mask): a sequence is kept or dropped whole.
    """
    # (S,)
    seq_ratio = torch.exp(
        sequence_log_ratio(old_logprobs, rollout_logprobs, mask, seq_ids, num_seqs)
    )
    seq_inside = (seq_ratio >= low) & (seq_ratio <= high)  # (S,)
    valid = mask > 0
    if num_seqs == 0:
        inside = torch.zeros_like(valid)
    else:
        inside = seq_inside[torch.where(valid, seq_ids, torch.zeros_like(seq_ids))]  # (T,)
    ratio = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask))
    keep = torch.where(valid & inside, torch.ones_like(ratio), torch.zeros_like(ratio))
    return keep, _stats(ratio, torch.zeros_like(inside), ~inside, mask)


def correct(
    mode: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Tuple[torch.Tensor, torch.Tensor, Stats]:
    """Dispatch by mode -> (weight (T,), keep (T,), stats): the trainer multiplies the per-token
    policy-gradient loss by `weight` and the loss mask by `keep`. Mode "none" gives ones for both
    (and the ratio statistics, for monitoring)."""
    ones = torch.ones_like(mask)
    if mode == "tis":
        weight, stats = tis(old_logprobs, rollout_logprobs, mask, cap)
        return weight, ones, stats
    if mode == "mis_token":
        keep, stats = mis_token(old_logprobs, rollout_logprobs, mask, low, high)
        return ones, keep, stats
    if mode == "mis_seq":
        keep, stats = mis_seq(old_logprobs, rollout_logprobs, mask, seq_ids, num_seqs, low, high)
        return ones, keep, stats
    if mode == "none":
        ratio = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask))
        never = torch.zeros_like(mask, dtype=torch.bool)
        return ones, ones, _stats(ratio, never, never, mask)
    raise ValueError(f"unknown rollout correction {mode!r}; valid: {', '.join(MODES)}")
