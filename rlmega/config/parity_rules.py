"""The parity guard's limits by dtype (rlmega.sync.parity applies them): rules of config values
(rollout.parity_warn, parity_stop by model.dtype), torch-free, so that config validation can read them quickly."""

from __future__ import annotations

# (warn, stop) limits of a step's on-policy max |rollout - trainer| log-prob difference, by dtype.
# float32: the floor measured here is 1e-6 on random-init tiny models and 3e-6..4.5e-5 per step on the
# demo's trained one; 1e-3 is 20x the largest of those, and the tied-head bug of issue 22 A showed
# 8e-3 at its first update, a skipped sync 4.1 (tests/e2e/test_train.py).
# bfloat16 (both sides bf16, vLLM on CUDA): `rlmega train configs/gpu_one.yaml` on one H200 (2026-11-28,
# tools/gpu/prove.py step a; Qwen2.5-0.5B's shape, vocabulary 151,936) measured 0.057..0.102 a step over 10
# steps of 256 samples, and tests/gpu/test_vllm_on_gpu.py 0.039..0.051 over 4,096 tokens a refit (H100,
# H200). Warn: 2.0, 20x the largest, as float32's. Stop: 10.0, a token whose probability differs e^10-fold,
# which bf16's rounding of a logit (2^-8 of it: ~0.1 at |logit| 30) does not make and other weights do. A
# single skipped sync moves log-probs by one update's change, below these: in bf16 the guard catches an
# engine on wrong weights, not one stale step (the float32 guard catches both).
PARITY_LIMITS = {"float32": (1e-3, 1e-2), "bfloat16": (2.0, 10.0)}


def parity_limits(dtype: str, warn: float | None, stop: float | None) -> tuple[float, float]:
    """(warn, stop) for a run: the configured values, else the dtype's measured defaults (PARITY_LIMITS)."""
    default_warn, default_stop = PARITY_LIMITS[dtype]
    return (default_warn if warn is None else warn), (default_stop if stop is None else stop)
