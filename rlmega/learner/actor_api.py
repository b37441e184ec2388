"""The learner's interface: what the driver, Roles and the launchers call on every trainer rank.

A backend is one class that subclasses ``Actor`` (rlmega/megatron/actor.py: MegatronActor,
rlmega/fsdp/actor.py: FSDPActor) and one line in ``BACKENDS``; ``actor.backend`` picks it and
``actor_class`` imports it, so nothing above this line (train.py, step.py, launch/, the producer)
imports a backend's library or asks which backend runs.

Rules every method follows (the contract the callers rely on):

- **Collective.** A WorkerGroup or TorchrunGroup calls each method on every rank with the same
  arguments; a method may run collectives, so no rank may skip a call another rank makes.
- **Planned once, each rank its share.** A batch's micro-batches are planned once, by the driver
  (rlmega/data/shards.py: packed under actor.max_tokens_per_micro_batch, balanced by tokens, as the
  backend's ``data_layout`` asks), and each data-parallel rank receives only its ``Shard``: a method that
  takes a batch takes a Shard, and answers per-sample results for the shard's own samples
  (rlmega/launch/sharded.py puts them back in batch order). A whole RolloutBatch is still accepted
  (tests, one process): every rank then plans it alike, runs its share and returns the whole result.
- **Per-sample results** (log-probs, entropies) are a list with one float32 (response_len,) tensor per
  sample, on the host, in batch order (a Shard's: its own samples, in order).
- **Global normalisation.** A loss is normalised over the global batch (all micro-batches of all
  ranks), never averaged per micro-batch or per rank: ``rlmega.algorithms.rl_loss`` gives each
  micro-batch's (numerator, count, stats); the backend sums them over everything, then divides once.
  So the gradient and the metrics do not depend on the layout or the token budget.
- **Same decisions on every rank.** A non-finite loss or grad norm is global, so every rank skips the
  optimizer step (actor.skip_nonfinite_steps) or raises FloatingPointError, together.
- **Float32 numerics where they matter.** Log-probs, entropies, losses and reductions are float32 even
  when the model computes in bfloat16 (model.dtype).
- **HF names at the edges.** ``sync_model_to_rollout`` and ``export_hf`` speak Hugging Face parameter
  names and layouts, whatever the backend holds inside.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib


from rlmega.algorithms import gae as gae_lib
from rlmega.algorithms import kl as kl_lib
from rlmega.config.schema import AlgorithmConfig
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.rundir.profiling import TraceRecorder

# actor.backend -> "module:Class" of each role a trainer rank can play (the critic: algorithm.advantage_estimator
# =gae, rlmega/learner/critic_api.py), imported only when that backend runs.
BACKENDS = {
    "megatron": "rlmega.megatron.actor:MegatronActor",
    "fsdp": "rlmega.fsdp.actor:FSDPActor",
}
CRITICS = {
    "megatron": "rlmega.megatron.critic:MegatronCritic",
    "fsdp": "rlmega.fsdp.critic:FSDPCritic",
}
_ROLES = {"actor": BACKENDS, "critic": CRITICS}


def _check(backend: str, role: str) -> None:
    if backend not in _ROLES[role]:
        what = "is not a backend" if role == "actor" else f"has no {role}"
        raise ValueError(f"actor.backend={backend!r} {what}; choose one of {sorted(_ROLES[role])}")


def backend_class(backend: str, role: str = "actor") -> type:
    """The class of ``role`` ("actor": an Actor, "critic": a Critic) on ``actor.backend`` (imports its
    package, and its library, only now)."""
    _check(backend, role)
    module, name = _ROLES[role][backend].split(":")
    return getattr(importlib.import_module(module), name)


def actor_class(backend: str) -> type["Actor"]:
    """The Actor subclass of ``actor.backend``."""
    return backend_class(backend, "actor")


@dataclasses.dataclass(frozen=True)
class BackendFactory:
    """A picklable stand-in for ``backend_class(backend, role)``: calling it in a rank's process builds that
    backend's Actor (or Critic) there. Launchers take it where they take a class (WorkerGroup,
    TorchrunGroup), so the driver never imports a backend's library (megatron-core, FSDP): only the ranks do."""

    backend: str
    role: str = "actor"

    def __post_init__(self):
        _check(self.backend, self.role)  # fail in the driver, before any rank starts

    def __call__(self, *args, **kwargs):
        return backend_class(self.backend, self.role)(*args, **kwargs)


def advantages_and_returns(batch: RolloutBatch, algo) -> tuple[list, list]:
    """GAE's (advantages, returns) of a judged batch with the critic's ``old_values``, by the algorithm
    section ``algo`` (rlmega.algorithms.gae.advantages_and_returns; Actor.compute_advantages_and_returns
    says what the batch carries). The driver calls it: pure arithmetic, no trainer rank involved."""
    a, masks = algo, batch.response_mask
    if batch.rewards is None or batch.old_values is None:
        raise ValueError(
            "compute_advantages_and_returns needs batch.rewards and batch.old_values (the critic's)"
        )
    kl = None
    if a.kl_coef > 0 and a.kl_in_reward:
        if batch.old_logprobs is None or batch.ref_logprobs is None:
            raise ValueError(
                "algorithm.kl_in_reward needs batch.old_logprobs and batch.ref_logprobs"
            )
        kl = [
            kl_lib.kl_penalty(o, r, a.kl_estimator)
            for o, r in zip(batch.old_logprobs, batch.ref_logprobs)
        ]
    return gae_lib.advantages_and_returns(
        batch.rewards,
        batch.old_values,
        masks,
        kl,
        gamma=a.gamma,
        lam=a.lam,
        lam_critic=a.lam_critic,
        lam_actor_alpha=a.lam_actor_alpha,
        whiten_advantages=a.whiten_advantages,
        kl_coef=a.kl_coef,
    )


class Actor(abc.ABC):
    """One trainer rank's learner. Constructed in the rank's own process (Ray actor, torchrun rank,
    or a test) as ``cls(model, parallel, optimizer, actor, algorithm, temperature=1.0,
    lr_decay_steps=1000, hf_config=None, num_threads=None, teachers=(), offload_teachers=True)`` from
    rlmega.config.schema's sections; ``hf_config`` builds the model from that config with random weights
    instead of model.path; ``num_threads`` sets the process's intra-op threads (None leaves them);
    ``teachers``: a ModelConfig per distillation teacher (frozen, built at the policy's layout, kept in host
    memory between passes when ``offload_teachers``). Nothing is built before ``setup``."""

    vocab_size: int
    """The model's vocabulary size, known after ``setup``."""
    algo: AlgorithmConfig
    """The algorithm section the actor was built with."""
    reference_moved: bool = False
    """The reference policy may differ from model.path (a copy after the warm start, a Polyak update,
    a reference restored from a checkpoint): from then on checkpoints carry it."""

    # ---- lifecycle ------------------------------------------------------------------------------
    @abc.abstractmethod
    def data_layout(self) -> tuple:
        """(rlmega.data.shards.Layout: how the policy wants a batch split, this rank's data-parallel rank),
        after ``setup``: the driver plans each batch with it once."""

    @abc.abstractmethod
    def setup(self, with_reference: bool = True) -> None:
        """Join the process group, build the policy (weights from model.path) with its optimizer and
        LR schedule, and, ``with_reference``, a frozen reference copy (offloaded to the host between
        uses when actor.offload_reference)."""

    def teardown(self) -> None:
        """Leave the process group (the process may then exit or set up again)."""

    # ---- forward passes -------------------------------------------------------------------------
    @abc.abstractmethod
    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        """Log-probs of every response token under the current policy at the rollout temperature,
        per sample; ``with_entropy``: (log-probs, entropies).

        MoE routing replay (algorithm.routing_replay, megatron backend): ``rollout`` replays
        batch.routed_experts (the engine's experts per token; -1 rows are routed by the trainer's own
        router and counted) here, in ``compute_ref_logprobs`` and in ``train_step``; ``trainer``
        records the routes this forward takes, and ``train_step`` replays them for the same sample ids.
        This forward's router_mismatch comes back in the results of the ``train_step`` calls after it
        (routes_live_fraction and expert load there are the train forward's own)."""

    @abc.abstractmethod
    def compute_ref_logprobs(self, batch: RolloutBatch) -> list:
        """``compute_logprobs`` under the reference policy. RuntimeError without a reference."""

    @abc.abstractmethod
    def compute_teacher_logprobs(self, batch: RolloutBatch, teacher: int) -> list:
        """``compute_logprobs`` under distillation teacher ``teacher`` (an index into the constructor's
        ``teachers``), at the sampling temperature, over the teacher's whole vocabulary."""

    # ---- training -------------------------------------------------------------------------------
    @abc.abstractmethod
    def train_step(
        self, batch: RolloutBatch, optimizer_steps_per_rl_step: int | None = None
    ) -> dict:
        """One RL optimizer step on the whole batch; returns ``rl_loss.step_metrics``'s dict.

        The batch needs advantages, ref_logprobs when the loss uses the KL term, rollout_logprobs when
        algorithm.rollout_correction is on (``rl_loss.check_train_batch`` refuses the rest), and
        old_logprobs unless ``optimizer_steps_per_rl_step == 1``: then the old log-probs are this
        forward's own, detached (ratio exactly 1), and the result holds them as "old_logprobs"
        (per sample, batch order, every rank), the same numbers ``compute_logprobs`` gives."""

    @abc.abstractmethod
    def sft_step(self, batch: RolloutBatch, lr: float | None = None) -> dict:
        """One supervised optimizer step on the responses (``rl_loss.sft_loss``, temperature 1).
        ``lr``: a constant learning rate outside the RL schedule, which it neither uses nor advances."""

    @abc.abstractmethod
    def advance_lr_schedule(self, steps: int) -> float:
        """Move the LR schedule on by ``steps`` optimizer steps without taking them; returns the LR now
        (a short batch takes fewer optimizer steps: this keeps the schedule on the RL-step clock)."""

    @abc.abstractmethod
    def update_ref_policy(self, rate: float | None = None) -> None:
        """ref <- (1 - rate) * ref + rate * policy, in float32 (bf16 references keep a float32 master);
        rate 1 copies exactly; None uses actor.ref_update_rate. Sets ``reference_moved``."""

    def compute_advantages_and_returns(self, batch: RolloutBatch) -> tuple[list, list]:
        """PPO with a critic (algorithm.advantage_estimator=gae): per-token advantages for the policy and
        returns for the critic, per sample (float32, batch order), as the seed API's entry point.

        The batch carries the judges' ``rewards`` (one per sample: on the last action token), the
        critic's ``old_values`` (rlmega.learner.critic_api.Critic.compute_values), and with
        algorithm.kl_in_reward the ``old_logprobs`` and ``ref_logprobs`` (a per-token KL penalty on the
        action tokens). Tool output (response_mask 0) is no action: no reward, advantage or return, and
        GAE's credit passes over it. Advantages use lam (or VAPO's length-adaptive lam_actor_alpha),
        returns lam_critic (default lam); advantages are whitened over the batch's action tokens when
        algorithm.whiten_advantages. Pure arithmetic (rlmega.algorithms.gae): no collective, the same
        result on every rank; the driver computes it itself (``advantages_and_returns``), this entry point
        is the seed API's."""
        return advantages_and_returns(batch, self.algo)

    # ---- weights out ----------------------------------------------------------------------------
    @abc.abstractmethod
    def sync_model_to_rollout(
        self, transport, version: int, bucket_bytes: int = 512 << 20, weights: str = "merged"
    ) -> dict:
        """Stream the policy's full weights, HF names and layouts, to the engines through
        ``transport`` (rlmega.sync.transports): size-bounded buckets, each gathered only when it is
        sent, so no rank holds the whole model; one sender calls ``transport.send(bucket, version)``
        per bucket then ``transport.flush()``; every rank meets at a closing barrier, so every bucket
        is loaded when any rank returns. Returns what this rank did: "gathered", "bytes", "tensors",
        "buckets", "names_and_shapes" [(name, shape)], "seconds". ``weights``: with LoRA adapters
        (actor.lora), "merged" into the weights or the "base" alone (``adapter_for_rollout`` sends them)."""

    @abc.abstractmethod
    def adapter_for_rollout(self) -> dict | None:
        """With LoRA adapters: a PEFT adapter folder's files ({file name: bytes}) on one rank (None on the
        others), for engines that serve the adapters unmerged. Collective."""

    @abc.abstractmethod
    def put_adapter_for_rollout(self) -> dict | None:
        """``adapter_for_rollout``'s files put into Ray's object store by that rank: {"ref": ObjectRef, "bytes":
        their size, "seconds": this call's time} there, None on the others. The engines read them from the
        store, not through the driver. Collective."""

    @abc.abstractmethod
    def save_checkpoint(self, root, step: int, extra: dict | None = None):
        """Policy, optimizer, LR schedule, every rank's RNG and ``extra`` (rank 0's plain values) under
        root/step_N, written to step_N.partial then renamed, and root/latest pointing at it; plus the
        reference once ``reference_moved``. A full disk raises rlmega.rundir.checkpoint_files.CheckpointSpaceError
        with the partial save removed. Returns the checkpoint's path."""

    @abc.abstractmethod
    def load_checkpoint(self, root, model_only: bool = False) -> tuple[int, dict]:
        """Restore what ``save_checkpoint`` wrote (root/latest, or ``root`` itself); returns (step, extra).
        ``model_only``: just the weights. The config's optimizer and LR settings win over the saved
        ones (only the step count is restored). A saved reference replaces the one from model.path."""

    @abc.abstractmethod
    def export_hf(self, out_dir, overwrite: bool = False):
        """The policy as a plain Hugging Face folder (safetensors + config + tokenizer files) that
        transformers and vLLM load; written whole, then renamed into place. Returns its path."""

    # ---- colocated GPUs -------------------------------------------------------------------------
    @abc.abstractmethod
    def offload_for_rollout(self, keep_params: bool = False) -> dict:
        """Only when actor.offload_while_generating: move the policy's state (grads, optimizer state,
        then parameters unless ``keep_params``, which a weight sync still reads) to host memory and
        return freed memory to the device. Returns {"offloaded": kinds on the host, "device_bytes"}."""

    @abc.abstractmethod
    def onload_for_training(self) -> dict:
        """Bring back what ``offload_for_rollout`` released (the optimizer state stays on the host when
        actor.offload_optimizer keeps it there between steps). Returns {"offloaded": kinds still out}."""

    # ---- profiling (logging.profile_steps): the same for every backend -----------------------------
    def start_profile(self) -> None:
        """Start recording this rank's trace (rlmega.rundir.profiling.TraceRecorder)."""
        self._trace = TraceRecorder()
        self._trace.start()

    def stop_profile(self, out_dir: str) -> str:
        """Write this rank's trace to out_dir/trainer_rank{R}.json; returns its path."""
        import torch.distributed as dist

        return self._trace.stop(f"{out_dir}/trainer_rank{dist.get_rank()}.json")
