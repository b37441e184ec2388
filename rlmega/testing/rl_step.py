"""One RL optimizer step on a WorkerGroup of actors, for tests that need the weights to move.

    metrics = train_step_on_fixed_rewards(group, batch)   # rank 0's train_step metrics

Rewards are arbitrary but fixed (the parity of each sample's token sum), so a test's update is the same
every run; advantages are GRPO's over ``batch.group_ids``; old log-probs come from ``compute_logprobs``
(so an MoE actor's router_mismatch is measured as in a real RL step).
"""

from __future__ import annotations

import dataclasses

import torch

from rlmega.algorithms import advantages
from rlmega.data.rollout_batch import RolloutBatch


class OneRank:
    """One in-process actor as a one-rank WorkerGroup (``group.call(name, ...)`` -> [its result])."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, name, *args, **kwargs):
        return [getattr(self.actor, name)(*args, **kwargs)]


def train_step_on_fixed_rewards(group, batch: RolloutBatch) -> dict:
    """compute_logprobs then train_step on ``batch`` (every rank); returns rank 0's metrics."""
    rewards = torch.tensor([float(sum(s.tolist()) % 2) for s in batch.tokens])
    seq_adv = advantages.grpo(rewards, batch.group_ids)
    old = group.call("compute_logprobs", batch)[0]
    train = dataclasses.replace(
        batch,
        old_logprobs=old,
        rewards=rewards,
        advantages=[torch.full_like(o, float(a)) for o, a in zip(old, seq_adv)],
    )
    return group.call("train_step", train)[0]


def step_with_reference(actor, batch: RolloutBatch, keys: tuple[str, ...]) -> tuple[dict, list]:
    """One RL step of an actor in this process (old and reference log-probs, then train_step on ``batch``'s own
    advantages): ({key: metric} for ``keys``, the reference log-probs)."""
    old, ref = actor.compute_logprobs(batch), actor.compute_ref_logprobs(batch)
    m = actor.train_step(dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref))
    return {k: m[k] for k in keys}, ref
