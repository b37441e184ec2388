"""The RL and SFT losses of one packed micro-batch, and the step metrics built from their sums.

Both backends (rlmega/megatron/actor.py, rlmega/fsdp/actor.py) call these, so a loss term or a
metric key exists once. A micro-batch is rlmega.data.micro_batches.build_micro_batch's dict: flat
per-token fields of T prediction positions ("loss_mask", "seq_ids", "advantages", "old_logprobs",
"ref_logprobs", "rollout_logprobs") and "num_seqs".

Each loss returns ``(numerator, count, stats)``: the backend sums numerators and counts over every
micro-batch and data-parallel rank and divides once (the loss is normalised over the global batch,
as Megatron's ``calculate_per_token_loss`` does), and sums each stat the same way; ``step_metrics``
turns those global sums into the metrics a train step reports.
"""

from __future__ import annotations

import torch

from rlmega.algorithms import kl as kl_lib
from rlmega.algorithms import losses
from rlmega.algorithms import rollout_correction as rc_lib

# The per-micro-batch sums every loss returns in ``stats`` (0-dim tensors), in this order.
STAT_KEYS = (
    "tokens",
    "pg_loss",
    "clipped",
    "ppo_kl",
    "entropy",
    "kl_ref",
    "rc_tokens",
    "rc_ratio",
    "rc_truncated",
    "rc_masked",
)
# What a backend sums over micro-batches and ranks: the loss's two parts, then the stats.
SUM_KEYS = ("numerator", "count", *STAT_KEYS)


# rl_loss's settings, by name: the algorithm section's fields of the same names (their defaults resolved,
# rlmega.config.schema.AlgorithmConfig.resolve_defaults); rlmega/learner/policy_actor.py hands them over as values.
SETTINGS = (
    "policy_loss",
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "kl_coef",
    "kl_in_reward",
    "kl_estimator",
    "entropy_coef",
    "loss_agg_mode",
    "rollout_correction",
    "rollout_is_cap",
    "rollout_is_bounds_low",
    "rollout_is_bounds_high",
)


def rl_loss(
    mb: dict,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    on_policy: bool = False,
    policy_loss: str,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float,
    kl_coef: float,
    kl_in_reward: bool,
    kl_estimator: str,
    entropy_coef: float,
    loss_agg_mode: str,
    rollout_correction: str,
    rollout_is_cap: float,
    rollout_is_bounds_low: float,
    rollout_is_bounds_high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The RL loss of one micro-batch: policy gradient (+ rollout correction, KL to the reference,
    entropy bonus), aggregated by ``loss_agg_mode``; the settings are the algorithm section's (SETTINGS).

    logprobs, entropy: (T,) this forward's, at the prediction positions. ``on_policy``: the old
    log-probs are this forward's own, detached (the RL step's only optimizer step): the PPO ratio is
    exactly 1 and the clip inactive.
    """
    mask, seq_ids, n = mb["loss_mask"], mb["seq_ids"], mb["num_seqs"]
    response_mask = mask  # every response token: the denominator of the token statistics
    old = logprobs.detach() if on_policy else mb["old_logprobs"]  # (T,)
    weight, rc = None, None
    if "rollout_logprobs" in mb:
        weight, keep, rc = rc_lib.correct(
            rollout_correction,
            old,
            mb["rollout_logprobs"],
            mask,
            seq_ids,
            n,
            rollout_is_cap,
            rollout_is_bounds_low,
            rollout_is_bounds_high,
        )
        if rollout_correction in ("mis_token", "mis_seq"):
            mask = mask * keep  # dropped tokens leave every loss term and its denominator (as verl)
    elif rollout_correction != "none":
        raise ValueError(
            f"algorithm.rollout_correction={rollout_correction} needs the rollout log-probs "
            "in the batch (RolloutBatch.rollout_logprobs)"
        )
    if policy_loss == "gspo":
        pg, st = losses.gspo(
            logprobs, old, mb["advantages"], mask, seq_ids, n, clip_eps_low, clip_eps_high
        )
    else:
        pg, st = losses.ppo_clip(
            logprobs,
            old,
            mb["advantages"],
            mask,
            clip_eps_low,
            clip_eps_high,
            dual_clip_c if policy_loss == "dual_clip" else None,
        )
    if rollout_correction == "tis":
        pg = pg * weight  # truncated IS weight, detached: corrects the sampling distribution
    total = pg
    kl_metric = torch.zeros_like(logprobs)
    if "ref_logprobs" in mb:
        if kl_coef > 0 and not kl_in_reward:
            total = (
                total
                + kl_coef * kl_lib.kl_penalty(logprobs, mb["ref_logprobs"], kl_estimator) * mask
            )
        # the metric is always k3's value, the unbiased (>= 0) estimate of KL(pi||ref), whatever
        # estimator the loss uses (k2's value is biased; see rlmega.algorithms.kl)
        kl_metric = kl_lib.kl_penalty(logprobs.detach(), mb["ref_logprobs"], "k3")
    if entropy_coef > 0:
        total = total + losses.entropy_bonus(entropy, mask, entropy_coef)
    numerator, count = losses.aggregate(total, mask, seq_ids, n, loss_agg_mode)
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    stats = {
        "tokens": response_mask.sum(),
        "pg_loss": losses.aggregate(pg.detach(), mask, seq_ids, n, loss_agg_mode)[0],
        "clipped": (st["clipped"] * mask).sum(),
        "ppo_kl": (st["ppo_kl"] * mask).sum(),
        "entropy": (entropy.detach() * response_mask).sum(),
        "kl_ref": (kl_metric * response_mask).sum(),
        "rc_tokens": response_mask.sum() if rc is not None else zero,
        "rc_ratio": rc["ratio"].sum() if rc is not None else zero,
        "rc_truncated": rc["truncated"].sum() if rc is not None else zero,
        "rc_masked": rc["masked"].sum() if rc is not None else zero,
    }
    return numerator, count, stats


def sft_loss(
    mb: dict, logprobs: torch.Tensor, entropy: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Supervised next-token loss on the response tokens (token mean over the global batch)."""
    mask = mb["loss_mask"]
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    nll = -(logprobs * mask).sum()
    stats = {
        "tokens": mask.sum(),
        "pg_loss": nll.detach(),
        "clipped": zero,
        "ppo_kl": zero,
        "entropy": (entropy.detach() * mask).sum(),
        "kl_ref": zero,
        "rc_tokens": zero,
        "rc_ratio": zero,
        "rc_truncated": zero,
        "rc_masked": zero,
    }
    return nll, mask.sum(), stats


def check_train_batch(
    batch,
    optimizer_steps_per_rl_step: int | None,
    *,
    kl_coef: float,
    kl_in_reward: bool,
    rollout_correction: str,
    **_,
) -> bool:
    """Refuse a RolloutBatch a train step cannot use; returns whether the step is on-policy (the
    batch has no old log-probs and this is the RL step's only optimizer step). The settings as rl_loss's
    (the others are taken and ignored, so the same dict serves both)."""
    if batch.advantages is None:
        raise ValueError("train_step needs batch.advantages")
    on_policy = batch.old_logprobs is None
    if on_policy and optimizer_steps_per_rl_step != 1:
        raise ValueError(
            "train_step needs batch.old_logprobs (compute_logprobs) unless it is the RL step's only "
            f"optimizer step; it was told optimizer_steps_per_rl_step={optimizer_steps_per_rl_step}: "
            "the steps after the first must compare with the policy before the first, which this "
            "forward no longer is. Pass optimizer_steps_per_rl_step=1 only for a single step."
        )
    if kl_coef > 0 and not kl_in_reward and batch.ref_logprobs is None:
        raise ValueError("algorithm.kl_coef > 0 needs batch.ref_logprobs (compute_ref_logprobs)")
    if rollout_correction != "none" and batch.rollout_logprobs is None:
        raise ValueError(
            f"algorithm.rollout_correction={rollout_correction} needs "
            "batch.rollout_logprobs (the engine's log-probs of the sampled tokens); "
            "set algorithm.rollout_correction=none for batches without them"
        )
    return on_policy


def global_loss(sums: dict) -> float:
    """The step's loss: the global numerator over the global count (at least 1)."""
    return sums["numerator"] / max(sums["count"], 1.0)


def _rollout_correction_metrics(s: dict) -> dict:
    """Token means of the rollout-correction statistics; NaN (unknown) when no token had rollout log-probs."""
    n = s["rc_tokens"]
    if n <= 0:
        return {
            "rollout_is_ratio": float("nan"),
            "rollout_is_truncated": float("nan"),
            "rollout_is_masked": float("nan"),
        }
    return {
        "rollout_is_ratio": s["rc_ratio"] / n,
        "rollout_is_truncated": s["rc_truncated"] / n,
        "rollout_is_masked": s["rc_masked"] / n,
    }


def step_metrics(
    sums: dict,
    efficiency: float,
    grad_norm: float,
    lr: float,
    ok: bool,
    old_logprobs: list | None = None,
) -> dict:
    """A train step's metrics from the global ``sums`` (SUM_KEYS -> float) of its micro-batches.

    ``efficiency``: the packing plan's padding efficiency; ``ok``: the optimizer step was taken;
    ``old_logprobs``: the on-policy path's per-sample log-probs, returned as "old_logprobs".
    """
    s = sums
    tokens = max(s["tokens"], 1.0)
    return {
        "loss": global_loss(s),
        "pg_loss": s["pg_loss"] / max(s["count"], 1.0),
        "pg_clipfrac": s["clipped"] / tokens,
        "ppo_kl": s["ppo_kl"] / tokens,
        "entropy": s["entropy"] / tokens,
        "kl_ref": s["kl_ref"] / tokens,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": int(s["tokens"]),
        "padding_fraction": 1.0 - efficiency,
        "skipped": 0.0 if ok else 1.0,
        **_rollout_correction_metrics(s),
        **({"old_logprobs": old_logprobs} if old_logprobs is not None else {}),
    }
