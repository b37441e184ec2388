"""A synthetic, verifiable task with long answers: recite a secret order of the alphabet, thousands of
letters long (configs/long_context_cpu.yaml trains it at 8k-token responses).

The task's order is the 26 lower-case letters shuffled by the data seed, read as a cycle: each letter has
one successor. ``"e:"`` asks for ``length`` letters starting at e's successor, each the successor of the
one before (26 prompts, one per start letter). Every one of the thousands of letters is scored
(rlmega.rewards.sequence: the fraction of positions that follow the order).

Why this rule (measured here with a 2-layer, hidden-128 Qwen2 and the HF trainer, float32): the model
learns the 26-entry successor table in ~30 warm-start steps of 4 x 1,024 tokens, and after ~12 it samples
the right successor ~55% of the time at temperature 1. configs/long_context_cpu.yaml takes 20: its
sampled 8k answers then follow the order at ~94% of the letters written but stop (EOS) after ~2,200 on
average, which leaves RL a visible climb (docs/backends.md). Rules a tiny model
must compute rather than look up did not work: digit i = (start + step * i) mod 10 with the step inferred
from the last two digits stayed at p(correct) 0.2 for 300 steps; with the step a letter in the prompt the
model copied the answer's own period instead of applying the rule, and sampled from the start it repeated
a wrong first period (reward 0.06).
"""

from __future__ import annotations

import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"
EVAL_PROMPTS = 10  # start letters the eval asks for (seeded): with 26 prompts none is unseen


def cycle(seed: int) -> str:
    """The task's order: the alphabet shuffled by ``seed``; each letter's successor is the next (the last's
    is the first)."""
    order = list(LETTERS)
    random.Random(seed).shuffle(order)
    return "".join(order)


def answer(start: str, length: int, seed: int) -> str:
    """The ``length`` letters after ``start`` in the order of ``seed``."""
    order = cycle(seed)
    i = order.index(start)
    return "".join(order[(i + 1 + j) % 26] for j in range(length))


def make_sequence_problems(
    n: int, length: int, seed: int = 0, eval_set: bool = False
) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs with start letters drawn at random (seeded), or with ``eval_set``
    EVAL_PROMPTS distinct start letters (n of them at most)."""
    if n < 0 or length < 1:
        raise ValueError(f"need n >= 0 and length >= 1, got n={n}, length={length}")
    rng = random.Random(seed + 1)
    starts = (
        rng.sample(LETTERS, min(n, EVAL_PROMPTS))
        if eval_set
        else [rng.choice(LETTERS) for _ in range(n)]
    )
    return [(f"{s}:", answer(s, length, seed)) for s in starts]
