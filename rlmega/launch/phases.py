"""The colocated phase machine: engines and trainer take turns on the same devices.

    generate -> train_phase [engines sleep, trainer onloads] -> log-probs, train ->
    rollout_phase [trainer releases grads + optimizer state; engines wake; weights sync;
                   trainer releases its parameters] -> generate ...

Every call is made on CPU too (engines answer sleep with False, the actor offloads only when
actor.offload_while_generating resolves to True), so CPU runs exercise the order. Roles
(rlmega/launch/roles.py) owns one and hands it the calls it makes:

    phases = ColocatedPhases(engines=call_every_engine, trainer=call_trainer, critic=call_critic_or_None,
                             swaps=True, critic_swaps=False, keep_engines_awake=False)
    phases.train_phase()                         # before the trainer computes
    sent = phases.rollout_phase(sync)            # around ``sync()``, the weight transfer
"""

from __future__ import annotations

from typing import Any, Callable

from rlmega.learner.actor_api import Actor
from rlmega.learner.critic_api import Critic


class ColocatedPhases:
    def __init__(
        self,
        engines: Callable[[str], list],
        trainer: Callable[..., Any],
        critic: Callable[..., Any] | None,
        swaps: bool,
        critic_swaps: bool,
        keep_engines_awake: bool,
    ):
        """``engines(method)``: that method on every engine, their answers; ``trainer(method, **kw)`` and
        ``critic(method, **kw)``: on every trainer (critic) rank, ``method`` the interface's own function
        (``Actor.offload_for_rollout``, ``Critic.onload_for_training``: rlmega/launch/roles.py). ``swaps``: the
        trainer releases its device memory while the engines generate (``critic_swaps``: the critic too);
        ``keep_engines_awake``: asynchronous production generates while the trainer trains, so the engines never
        sleep for it."""
        self.engines, self.trainer, self.critic = engines, trainer, critic
        self.swaps, self.critic_swaps, self.keep_engines_awake = (
            swaps,
            critic_swaps and critic is not None,
            keep_engines_awake,
        )
        self.engines_asleep = False
        self.trainer_released = False
        # the critic swaps on its own setting (critic.offload_while_generating)
        self.critic_released = False

    def train_phase(self) -> None:
        """Engines free their GPU memory, the trainer takes its parameters and state back."""
        if not self.engines_asleep and not self.keep_engines_awake:
            self.engines_asleep = any(self.engines("sleep"))
        self.trainer(Actor.onload_for_training)
        if self.critic_swaps:
            self.critic(Critic.onload_for_training)
        self.trainer_released = self.critic_released = False

    def rollout_phase(self, sync: Callable[[], dict]) -> dict:
        """After training: release the trainer, wake the engines, ``sync()`` the new weights into them, then
        release the parameters the sync read. Returns what ``sync`` did."""
        self.release_trainer(keep_params=True)  # the sync below still reads the parameters
        self.wake_engines()
        sent = sync()
        self.release_trainer(keep_params=False)
        return sent

    def before_generation(self) -> None:
        """Generation outside the cycle (evaluation, requeued groups): the engines need the devices."""
        if self.engines_asleep:
            self.release_trainer(keep_params=False)
            self.wake_engines()

    def before_sync(self) -> None:
        """A weight sync reads the trainer's parameters and writes the engines': both resident."""
        if self.trainer_released:
            self.train_phase()
        self.wake_engines()

    def before_training(self) -> None:
        """A trainer or critic call: bring a released trainer (or critic: a checkpoint, an export) back first."""
        if self.trainer_released or self.critic_released:
            self.train_phase()

    def release_trainer(self, keep_params: bool) -> None:
        self.trainer(Actor.offload_for_rollout, keep_params=keep_params)
        if self.critic_swaps and not keep_params:  # no sync reads the critic
            self.critic(Critic.offload_for_rollout)
            self.critic_released = True
        self.trainer_released = self.swaps and not keep_params

    def wake_engines(self) -> None:
        if self.engines_asleep:
            self.engines("wake_up")
            self.engines_asleep = False
