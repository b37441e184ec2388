"""The critic's loss of one packed micro-batch, and the critic step's metrics built from their sums.

Both backends' critics (rlmega/megatron/critic.py, rlmega/fsdp/critic.py) call these, as the actors call
rlmega.algorithms.rl_loss: ``critic_loss`` returns ``(numerator, count, stats)`` per micro-batch, the
backend sums them over every micro-batch and data-parallel rank and divides once (a loss normalised over
the global batch, whatever the layout or token budget), and ``critic_metrics`` turns the global sums into
the step's metrics.
"""

from __future__ import annotations

import torch

from rlmega.algorithms import losses

# Per-micro-batch sums in ``stats`` (0-dim tensors). The explained variance needs the returns' and the
# residuals' first two moments over the global batch, which sum over micro-batches and ranks.
STAT_KEYS = ("tokens", "vf_loss", "vf_clipped", "value", "ret", "ret_sq", "res", "res_sq")
SUM_KEYS = ("numerator", "count", *STAT_KEYS)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    values, old_values, returns: (T,). ``cliprange`` None (or <= 0): the plain 0.5 * (v - R)^2.
    Returns (loss (T,), clipped (T,) float: 1 where the clipped term is the larger one).
    """
    plain = (values - returns) ** 2
    if cliprange is None or cliprange <= 0:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped_v = old_values + (values - old_values).clamp(-cliprange, cliprange)
    clipped = (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), (clipped > plain).float()


def critic_loss(
    mb: dict, values: torch.Tensor, cliprange: float | None, loss_agg_mode: str = "token-mean"
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The value loss of one micro-batch (build_micro_batch's dict with "returns" and "old_values").

    values: (T,) this forward's values at the prediction positions (position p scores the state before
    the token at p + 1, as log-probs do). Masked tokens (tool output, padding) are in no term: they are
    not actions, and GAE gave them no return. ``loss_agg_mode``: as the policy loss's
    (rlmega.algorithms.losses.aggregate), so both losses weigh tokens and sequences alike.
    """
    mask, seq_ids, n = mb["loss_mask"], mb["seq_ids"], mb["num_seqs"]
    returns = mb["returns"]
    old = mb["old_values"] if "old_values" in mb else values.detach()
    per_token, clipped = clipped_value_loss(values, old, returns, cliprange)
    numerator, count = losses.aggregate(per_token, mask, seq_ids, n, loss_agg_mode)
    v, residual = values.detach(), returns - values.detach()
    stats = {
        "tokens": mask.sum(),
        "vf_loss": numerator.detach(),
        "vf_clipped": (clipped * mask).sum(),
        "value": (v * mask).sum(),
        "ret": (returns * mask).sum(),
        "ret_sq": (returns**2 * mask).sum(),
        "res": (residual * mask).sum(),
        "res_sq": (residual**2 * mask).sum(),
    }
    return numerator, count, stats


def critic_metrics(sums: dict, grad_norm: float, lr: float, ok: bool) -> dict:
    """The critic step's metrics from the global ``sums`` (SUM_KEYS -> float): value loss, mean value,
    value clip fraction, explained variance 1 - Var(R - V) / Var(R) over the batch's action tokens (NaN
    when the returns do not vary), grad norm, LR, whether the optimizer step was taken."""
    s = sums
    n = max(s["tokens"], 1.0)
    var_ret = s["ret_sq"] / n - (s["ret"] / n) ** 2
    var_res = s["res_sq"] / n - (s["res"] / n) ** 2
    return {
        "critic/vf_loss": s["numerator"] / max(s["count"], 1.0),
        "critic/value_mean": s["value"] / n,
        "critic/vf_clipfrac": s["vf_clipped"] / n,
        "critic/return_mean": s["ret"] / n,
        "critic/explained_variance": 1.0 - var_res / var_ret if var_ret > 1e-12 else float("nan"),
        "critic/grad_norm": grad_norm,
        "critic/lr": lr,
        "critic/skipped": 0.0 if ok else 1.0,
    }
