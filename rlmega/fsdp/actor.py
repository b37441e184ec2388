"""FSDPActor: the learner on one trainer rank, torch FSDP2 over any Hugging Face causal LM: PolicyActor with FSDPEngine.

The same interface and the same numbers as MegatronActor (rlmega.learner.actor_api.Actor is the contract; the RL
logic is rlmega/learner/policy_actor.py's, how a step maps onto FSDP2 is rlmega/fsdp/engine.py's); all ranks are
data-parallel and each holds a shard of every parameter. RLinf's FSDP actor's entry points stay:

    actor = FSDPActor(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor, cfg.algorithm,
                      temperature=cfg.rollout.temperature)
    actor.init_worker()                     # = setup(): process group, policy, reference
    old = actor.compute_logprobs(batch)     # list of (response_len,) per sample, every rank
    metrics = actor.train_step(replace(batch, old_logprobs=old, advantages=adv))
"""

from __future__ import annotations

from rlmega.fsdp.engine import FSDPEngine, _no_dropout, _reshard  # noqa: F401 (tests and tools import them here)
from rlmega.learner.policy_actor import PolicyActor


class FSDPActor(PolicyActor):
    engine_class = FSDPEngine
    global_step = 0
    """The trainer's RL step (set_global_step), for what is named by it (profiles)."""

    # ---- RLinf's entry points ---------------------------------------------------------------------
    def init_worker(self, with_reference: bool = True) -> None:
        """Join the process group, build the policy with optimizer and schedule, and the reference."""
        self.setup(with_reference)

    def model_provider_func(self, with_optimizer: bool = True) -> FSDPEngine:
        """A sharded model (weights from model.path, or ``hf_config`` at random), with an optimizer
        and LR schedule when ``with_optimizer`` (the policy), without (the reference)."""
        return self._engine(with_optimizer)

    def set_global_step(self, global_step: int) -> None:
        """The trainer's RL step, for what is named by it (profiles); the LR schedule keeps its own count."""
        self.global_step = int(global_step)
