"""RewardWorker: scores responses with the reward function named in the config (reward.fn).

A plain class that Ray hosts (``reward.num_workers`` of them share each step's samples):

    worker = RewardWorker("rlmega.rewards.arithmetic.score", kwargs={})
    worker.score([("46</s>", "46"), ("47", "46")])   # -> [1.0, 0.0]
"""
from __future__ import annotations

import math

from rlmega.rewards.registry import resolve


class RewardWorker:
    def __init__(self, fn: str, kwargs: dict | None = None):
        self.fn_path, self.fn, self.kwargs = fn, resolve(fn), dict(kwargs or {})

    def score(self, items: list[tuple[str, str]]) -> list[float]:
        """One float per (response text, label); a non-number or NaN is an error naming the item."""
        out = []
        for i, (response, label) in enumerate(items):
            value = self.fn(response, label, **self.kwargs)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"{self.fn_path} returned {value!r} for item {i}; a reward must be a number") from None
            if not math.isfinite(value):
                raise ValueError(f"{self.fn_path} returned {value} for item {i} (label {label!r})")
            out.append(value)
        return out
