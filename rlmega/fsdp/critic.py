"""FSDPCritic: the value model of PPO on torch FSDP2 trainer ranks: ValueCritic with FSDPEngine.

The policy's architecture as transformers' ``AutoModelForTokenClassification`` with one label, no bias and
no dropout (rlmega/fsdp/value_model.py), sharded, optimised, checkpointed and offloaded exactly as
FSDPActor's policy (an FSDPEngine with ``value_head``), through the same packed micro-batches: the head's
output at position p is the value of the state before the token at p + 1, so the values sit on the
log-probs' prediction positions and each sample gets its (response_len,).

    critic = FSDPCritic(**critic_kwargs(cfg))   # rlmega.config.resolved; in each trainer rank's process
    critic.setup()                              # process group, value model, AdamW, LR schedule
    old = critic.compute_values(batch)          # list of (response_len,) float32, every rank
"""

from __future__ import annotations

from rlmega.fsdp.engine import FSDPEngine
from rlmega.learner.value_critic import ValueCritic


class FSDPCritic(ValueCritic):
    engine_class = FSDPEngine
