"""MegatronCritic: the value model on one trainer rank over megatron-core: ValueCritic with MegatronEngine.

The policy's GPTModel with a hidden -> 1 output layer (rlmega/megatron/value_head.py), packed micro-batches
and the pipeline schedule exactly as the actor runs them (rlmega/megatron/engine.py), and
rlmega.algorithms.value_loss's loss and metrics (rlmega/learner/value_critic.py).

    critic = MegatronCritic(**critic_kwargs(cfg))       # rlmega.config.resolved
    critic.setup()
    values = critic.compute_values(batch)               # per sample (response_len,) float32
"""

from __future__ import annotations

from rlmega.megatron.engine import MegatronEngine
from rlmega.learner.value_critic import ValueCritic


class MegatronCritic(ValueCritic):
    """The Critic interface (rlmega/learner/critic_api.py) over megatron-core."""

    engine_class = MegatronEngine
