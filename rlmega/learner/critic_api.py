"""The critic's interface: a value model on the trainer ranks, for ``algorithm.advantage_estimator: gae``.

A backend's critic is one class that subclasses ``Critic`` (rlmega/megatron/critic.py: MegatronCritic,
rlmega/fsdp/critic.py: FSDPCritic) and one line in rlmega.learner.actor_api.CRITICS; ``actor.backend`` picks it (the
critic runs on the actor's backend) and ``critic_class`` imports it, so nothing above this line imports a
backend's library. The rules of rlmega/learner/actor_api.py hold here too: every method is collective (every
rank, same other arguments), a batch planned once with each data-parallel rank its share (or the whole
batch in, the whole result out), losses normalised over the global batch,
the same skip decision on every rank, float32 values whatever the model computes in.

The value model is the policy's architecture with its output layer replaced by a hidden -> 1 projection
(``score.weight``, rlmega/config/value_model.py). Position p of a sequence carries the value of the state
before the token at p + 1, so a sample's values line up with its response tokens exactly as its
log-probs do: one float32 per response token.
"""

from __future__ import annotations

import abc

from rlmega.learner.actor_api import BackendFactory, backend_class
from rlmega.data.rollout_batch import RolloutBatch


def critic_class(backend: str) -> type["Critic"]:
    """The Critic subclass of ``actor.backend`` (rlmega.learner.actor_api.CRITICS; imports its library only now)."""
    return backend_class(backend, "critic")


def critic_factory(backend: str) -> BackendFactory:
    """A picklable stand-in for ``critic_class(backend)`` (rlmega.learner.actor_api.BackendFactory)."""
    return BackendFactory(backend, role="critic")


class Critic(abc.ABC):
    """One trainer rank's value model. Constructed in the rank's own process as ``cls(model, parallel,
    optimizer, critic, max_tokens_per_micro_batch=2048, loss_agg_mode="token-mean", lr_decay_steps=1000,
    hf_config=None, num_threads=None)``: ``model`` is the critic's ModelConfig (path: a critic's or a causal
    LM's HF folder; dtype; seed: the fresh head's), ``critic`` its CriticConfig (cliprange_value),
    ``rlmega.config.resolved.critic_kwargs(cfg)`` gives them all for a run; ``hf_config`` (a causal LM's
    config dict) builds the body from it with random weights instead of a path; ``num_threads`` as the
    actor's."""

    @abc.abstractmethod
    def data_layout(self) -> tuple:
        """(rlmega.data.shards.Layout, this rank's data-parallel rank), after ``setup`` (Actor.data_layout)."""

    @abc.abstractmethod
    def setup(self) -> None:
        """Join the process group and build the value model with its optimizer and LR schedule: from
        critic.path, a critic's export (``score.weight`` included) or a causal LM (the policy: its body,
        and a fresh head from rlmega.config.value_model.fresh_value_head)."""

    def teardown(self) -> None:
        """Leave the process group."""

    @abc.abstractmethod
    def compute_values(self, batch: RolloutBatch) -> list:
        """V of every response token's state under the current critic, per sample (float32, host)."""

    @abc.abstractmethod
    def train_step(self, batch: RolloutBatch) -> dict:
        """One optimizer step of the clipped value loss on the whole batch (needs ``returns``;
        ``old_values`` are the clip's centre, this forward's own values when absent). Returns
        rlmega.algorithms.value_loss.critic_metrics's dict."""

    @abc.abstractmethod
    def save_checkpoint(self, root, step: int):
        """Model, optimizer, LR schedule under root/step_N (written whole, then renamed), root/latest."""

    @abc.abstractmethod
    def load_checkpoint(self, root) -> int:
        """Restore what ``save_checkpoint`` wrote (root/latest or ``root`` itself); returns the step."""

    @abc.abstractmethod
    def export_hf(self, out_dir, overwrite: bool = False):
        """The critic as an HF ``XForTokenClassification`` folder (num_labels 1), written whole."""

    @abc.abstractmethod
    def offload_for_rollout(self) -> dict:
        """Move parameters, grads and optimizer state to the host (colocated GPUs)."""

    @abc.abstractmethod
    def onload_for_training(self) -> dict:
        """Bring back what ``offload_for_rollout`` moved."""
