"""A synthetic, verifiable task: multi-digit addition answered after '='.

``make_problems(3, digits=2, seed=0)`` -> ``[("12+34=", "46"), ...]``. Seeded and pure, so a
warm start, the RL prompts and the verifier all agree on the data without shipping any.
"""

from __future__ import annotations

import random


def make_problems(n: int, digits: int = 2, seed: int = 0) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs; operands have 1..digits digits."""
    if n < 0 or digits < 1:
        raise ValueError(f"need n >= 0 and digits >= 1, got n={n}, digits={digits}")
    rng = random.Random(seed)
    hi = 10**digits - 1
    out = []
    for _ in range(n):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        out.append((f"{a}+{b}=", str(a + b)))
    return out
