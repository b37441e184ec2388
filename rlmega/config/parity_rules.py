"""The parity guard's limits by dtype (rlmega.sync.parity applies them): rules of config values
(rollout.parity_warn, parity_stop by model.dtype), torch-free, so that config validation can read them quickly."""
from __future__ import annotations

# (warn, stop) limits of a step's on-policy max |rollout - trainer| log-prob difference, by dtype.
# float32: the floor measured here is 1e-6 on random-init tiny models and 3e-6..4.5e-5 per step on the
# demo's trained one; 1e-3 is 20x the largest of those, and the tied-head bug of issue 22 A showed
# 8e-3 at its first update, a skipped sync 4.1 (tests/e2e/test_train.py). bfloat16: no floor has been
# measured yet (its log-probs differ far more, by rounding alone), so the guard is off unless
# rollout.parity_warn / parity_stop are set.
PARITY_LIMITS = {"float32": (1e-3, 1e-2), "bfloat16": (None, None)}


def parity_limits(dtype: str, warn: float | None, stop: float | None) -> tuple[float | None, float | None]:
    """(warn, stop) for a run: the configured values, else the dtype's defaults (PARITY_LIMITS); None
    where neither gives one (that action is off)."""
    default_warn, default_stop = PARITY_LIMITS[dtype]
    return (default_warn if warn is None else warn), (default_stop if stop is None else stop)
