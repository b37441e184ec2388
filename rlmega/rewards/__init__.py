"""Reward functions, addressed from configs by dotted path (`reward.fn: rlmega.rewards.arithmetic.score`) or by
file (`reward.fn: path/to/file.py:function`).

A reward function is `fn(response_text: str, label, **kwargs) -> float` (or a dict of named scores
holding "reward", for judgers): the generated text after the prompt decoded without special tokens, the
dataset row's label, and `reward.kwargs` (or a judger's kwargs); more of the item by name (the prompt, the
raw text, the row's other columns: rlmega/judgers/native.py, docs/your_own.md). `resolve(path)` imports one.

Built in (BUILT_IN, by dotted path; each module is imported only when named):
  rlmega.rewards.arithmetic.score   the synthetic addition task's exact-answer check
  rlmega.rewards.math.score         math answers compared by math-verify (\\boxed{...}, LaTeX, plain)
  rlmega.rewards.format.boxed       exactly one \\boxed{...}
  rlmega.rewards.format.ends_with_eos  the response ended by itself
  rlmega.rewards.format.tool_format    every <tool>name:args</tool> call well formed
"""

from rlmega.config.dotted_path import RewardResolveError, resolve

BUILT_IN = (
    "rlmega.rewards.arithmetic.score",
    "rlmega.rewards.math.score",
    "rlmega.rewards.format.boxed",
    "rlmega.rewards.format.ends_with_eos",
    "rlmega.rewards.format.tool_format",
)

__all__ = ["resolve", "RewardResolveError", "BUILT_IN"]
