"""Train/rollout log-prob parity: the engine's log-probs of sampled tokens vs the actor's."""
from __future__ import annotations

import torch


def logprob_diff(rollout: list[torch.Tensor], actor: list[torch.Tensor],
                 masks: list[torch.Tensor] | None = None) -> dict[str, float]:
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
