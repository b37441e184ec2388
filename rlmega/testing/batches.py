"""Synthetic RolloutBatches for tests and benchmarks (no rollout engine needed)."""

from __future__ import annotations

import torch

from rlmega.algorithms import advantages as adv_lib
from rlmega.data.rollout_batch import RolloutBatch


def random_batch(
    n: int = 8,
    vocab: int = 59,
    seed: int = 0,
    prompt_len=(3, 7),
    response_len=(2, 9),
    group_size: int = 2,
) -> RolloutBatch:
    """n samples of random tokens with GRPO advantages from random 0/1 rewards.

    Response masks drop the last token of every third sample (as a truncated tool output would).
    """
    g = torch.Generator().manual_seed(seed)
    tokens, prompt_lens, masks = [], [], []
    for i in range(n):
        p = int(torch.randint(*prompt_len, (1,), generator=g))
        r = int(torch.randint(*response_len, (1,), generator=g))
        tokens.append(torch.randint(0, vocab, (p + r,), generator=g))
        prompt_lens.append(p)
        m = torch.ones(r)
        if i % 3 == 2 and r > 1:
            m[-1] = 0.0
        masks.append(m)
    group_ids = torch.arange(n) // group_size
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    seq_adv = adv_lib.grpo(rewards, group_ids)
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=torch.tensor(prompt_lens),
        response_mask=masks,
        group_ids=group_ids,
        sample_ids=torch.arange(n),
        rewards=rewards,
        advantages=[torch.full((len(m),), float(a)) for m, a in zip(masks, seq_adv)],
    )
