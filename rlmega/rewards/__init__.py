"""Reward functions, addressed from configs by dotted path (`reward.fn: rlmega.rewards.arithmetic.score`).

A reward function is `fn(response_text: str, label, **kwargs) -> float`: the generated text after
the prompt, the dataset row's label, and `reward.kwargs`. `resolve(path)` imports one.
"""
from rlmega.rewards.registry import RewardResolveError, resolve

__all__ = ["resolve", "RewardResolveError"]
