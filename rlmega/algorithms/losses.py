"""Policy-gradient losses over the flat tokens of a packed micro-batch, and their aggregation.

Shapes: every token tensor is (T,); `mask` (T,) float is 1.0 on response tokens that count;
`seq_ids` (T,) int64 names each token's sequence in [0, num_seqs) (tokens with mask 0 may carry any id).
Per-token losses are returned unreduced; `aggregate` turns them into a (numerator, denominator)
pair so that the loss of the global batch is sum(numerators) / sum(denominators).

Pure functions: tensors and scalars in, tensors out; no config objects, no process groups.
"""

from typing import Dict, Optional, Tuple

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Log-ratios beyond +-20 (ratio ~4.9e8) carry no signal and would overflow exp() in low precision;
# a stale old_logprob of a near-impossible token can otherwise produce inf, and inf * 0 = NaN.
LOG_RATIO_CLAMP = 20.0

Stats = Dict[str, torch.Tensor]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over tokens with mask > 0; x, mask: (T,) -> scalar tensor (0 for an empty mask)."""
    total = torch.where(mask > 0, x * mask, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1.0)


def _segment_sum(
    values: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """sum over masked tokens of each sequence: values (T,) -> (num_seqs,).

    `where` (not values * mask) so NaN/inf garbage on padding cannot leak in; masked-out tokens are
    routed to slot 0 with value 0 so that an out-of-range id on them is harmless.
    """
    valid = mask > 0
    vals = torch.where(valid, values * mask, torch.zeros_like(values))
    ids = torch.where(valid, seq_ids, torch.zeros_like(seq_ids))
    out = torch.zeros(max(num_seqs, 1), dtype=vals.dtype, device=vals.device)
    return out.index_add(0, ids, vals)[:num_seqs]


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) per token, and where the clipped branch won.

    `where` picks one branch explicitly: torch.maximum splits the gradient between tied branches,
    and "clipped" must mean exactly "the gradient through the ratio is cut here".
    """
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    # strict: inside the range both are equal and the gradient flows
    took_clip = clipped > unclipped
    return torch.where(took_clip, clipped, unclipped), took_clip


def _finish(
    loss: torch.Tensor,
    took_clip: torch.Tensor,
    ppo_kl: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
) -> Tuple[torch.Tensor, Stats]:
    """Zero everything off the mask; stats are detached and masked so sum(stat)/sum(mask) is their mean."""
    valid = mask > 0
    zero = torch.zeros_like(loss)
    stats = {
        "clipped": torch.where(valid, took_clip.to(loss.dtype), zero).detach(),
        "ppo_kl": torch.where(valid, ppo_kl, zero).detach(),
        "ratio": torch.where(valid, ratio, zero).detach(),
    }
    return torch.where(valid, loss * mask, zero), stats


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate (Schulman et al. 2017), per token.

    logprobs: (T,) current policy, with grad; old_logprobs: (T,) behaviour policy; advantages: (T,);
    mask: (T,) -> loss: (T,) (0 off the mask) and stats {"clipped", "ppo_kl", "ratio"}: each (T,).
    ratio = exp(logp - old) (log-ratio clamped to [-20, 20]);
    loss = -min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A).
    clip_high > clip_low is DAPO's clip-higher (room for low-probability tokens to grow).
    dual_clip_c (> 1, Ye et al. 2020): for A < 0 the loss is further capped at -c*A, because with
    A < 0 the min above is unbounded as the ratio grows. "clipped" is 1 wherever either cap set the
    value, i.e. wherever the gradient is cut. "ppo_kl" = old - logp, the k1 estimate of KL(old||new).
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(
            f"dual_clip_c must be > 1 (got {dual_clip_c}); use None to disable dual-clip"
        )
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (T,)
    ratio = torch.exp(log_ratio)
    loss, took_clip = _clipped_objective(ratio, advantages, clip_low, clip_high)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages  # (T,), > 0 where A < 0
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        took_clip = took_clip | capped
    return _finish(loss, took_clip, old_logprobs - logprobs, ratio, mask)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> Tuple[torch.Tensor, Stats]:
    """GSPO-token (Zheng et al. 2025): PPO clipping on a length-normalised SEQUENCE ratio.

    logprobs, old_logprobs, advantages, mask: (T,); seq_ids: (T,) int64; num_seqs: S
    -> loss: (T,) and stats {"clipped", "ppo_kl", "ratio"}: each (T,); "ratio" is s_i on its tokens.
    s_i = exp(mean over sequence i's masked tokens of (logp - old)): the geometric mean of token
    ratios, so one outlier token cannot dominate and long sequences are not penalised.
    s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) has the value s_i and the gradient s_i * grad logp_t.
    loss_t = -min(s_i,t*A_t, clip(s_i,t, 1-clip_low, 1+clip_high)*A_t). Clip ranges are tiny (the
    paper's 3e-4 / 4e-4) because a sequence ratio moves far less than a token ratio. Clipping, and so
    "clipped", is all-or-nothing per sequence when A is constant over it.
    Aggregating with "seq-mean-token-mean" gives the paper's sequence-level GSPO gradient.
    """
    log_ratio = logprobs - old_logprobs  # (T,)
    # one slot even for S == 0 so the gather below never indexes an empty tensor
    slots = max(num_seqs, 1)
    seq_len = _segment_sum(torch.ones_like(mask), seq_ids, mask, slots)  # (S,)
    # (S,)
    seq_mean = _segment_sum(log_ratio.detach(), seq_ids, mask, slots) / seq_len.clamp(min=1.0)
    valid = mask > 0
    # (T,) token's s_i in log
    tok_seq_mean = seq_mean[torch.where(valid, seq_ids, torch.zeros_like(seq_ids))]
    tok_seq_mean = torch.where(valid, tok_seq_mean, torch.zeros_like(tok_seq_mean))
    # logp - sg(logp) is exactly 0 in value but carries d/dlogp = 1, so ratio == s_i with grad s_i.
    log_tok_ratio = (tok_seq_mean + logprobs - logprobs.detach()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    ratio = torch.exp(log_tok_ratio)  # (T,)
    loss, took_clip = _clipped_objective(ratio, advantages, clip_low, clip_high)
    return _finish(loss, took_clip, old_logprobs - logprobs, ratio, mask)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Loss term rewarding entropy: entropy, mask: (T,) -> -coef * entropy * mask: (T,)."""
    return -coef * entropy * mask


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, mode: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reduce one micro-batch's per-token loss to (numerator, denominator), both 0-dim tensors on
    the loss's device (a Python float would make the host wait for the device every micro-batch).

    per_token, mask: (T,); seq_ids: (T,) int64; num_seqs: S; mode in AGGREGATIONS.
      token-mean:          (sum_t l*m,                              sum_t m)
      seq-mean-token-sum:  (sum_i sum_{t in i} l*m,                 #sequences with any masked token)
      seq-mean-token-mean: (sum_i (sum_{t in i} l*m / sum_{t in i} m), same count)
    Why a pair and not a mean: a mean per micro-batch, averaged over micro-batches and data-parallel
    ranks, weights a micro-batch of 3 tokens like one of 3000 and changes with how the batch was
    packed. Megatron's schedule (and our DP all-reduce) sums numerators and denominators separately
    over micro-batches and ranks, so the result is the normalisation over the WHOLE global batch,
    independent of the split. This holds as long as no sequence is split across micro-batches.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    if mode == "token-mean":
        numerator = torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token)).sum()
        return numerator, mask.sum()
    seq_sum = _segment_sum(per_token, seq_ids, mask, num_seqs)  # (S,)
    # (S,) masked token counts
    seq_len = _segment_sum(torch.ones_like(mask), seq_ids, mask, num_seqs)
    present = seq_len > 0  # sequences with no response token (e.g. truncated prompt) do not count
    if mode == "seq-mean-token-mean":
        seq_sum = torch.where(present, seq_sum / seq_len.clamp(min=1.0), torch.zeros_like(seq_sum))
    return seq_sum.sum(), present.sum().to(seq_sum.dtype)
