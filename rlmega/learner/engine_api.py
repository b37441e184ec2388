"""The backend engine: what only a learner backend can do, for ONE model on one trainer rank.

The RL logic is written once above it (rlmega/learner/policy_actor.py: PolicyActor, rlmega/learner/value_critic.py:
ValueCritic); a backend implements this interface once (rlmega/megatron/engine.py: MegatronEngine over
megatron-core's pipeline schedule, rlmega/fsdp/engine.py: FSDPEngine over FSDP2), and its actor and
critic are PolicyActor and ValueCritic with that engine class. An actor holds a policy engine (with
optimizer) and, for KL, a reference engine (without); a critic one value engine.

    engine = MegatronEngine(model, parallel, optimizer, actor, lr_decay_steps=..., with_optimizer=True)
    engine.build()                                          # model (+ optimizer and LR schedule)
    shard = engine.shard(batch)                             # this rank's share (or the driver's Shard)
    mbs = engine.micro_batches(shard)                       # its packed micro-batches
    outs = engine.forward(mbs, Head(temperature=0.7))       # per micro-batch {"logprobs": (T,)} (no grad)
    lp = engine.gather_responses(mbs, outs, "logprobs", shard)   # per sample of the shard
    outs = engine.forward_backward(mbs, Head(entropy=True), loss_fn)   # per micro-batch sums
    sums = engine.global_sums(outs, SUM_KEYS)               # over micro-batches and ranks
    engine.normalize_grads(sums["count"])                   # the global token mean
    step = engine.optimizer_step()                          # StepResult(taken, grad_norm, lr)

Rules every engine keeps: every method is collective over the trainer's ranks (each calls it with the
same arguments); per-token outputs and sums are float32/float64 whatever the model computes in; a
loss's gradient is normalised over the global ``count`` (all micro-batches of all ranks) once
``normalize_grads(count)`` ran; ``forward``/``forward_backward`` return None on ranks that hold no model
output (a pipeline stage before the last), and ``gather_responses``/``global_sums`` give every rank
the same full result from there.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Iterator, Literal, NamedTuple

import torch

from rlmega.data.micro_batches import build_micro_batch
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.shards import Layout, Shard, plan_step


@dataclasses.dataclass(frozen=True)
class Head:
    """What a pass computes at every token from the model's output.

    ``kind="logprobs"``: the log-prob of the token's label under softmax(logits / temperature), float32,
    and with ``entropy`` the distribution's entropy (differentiated only with ``entropy_grad``; else a
    metric, computed without a graph). ``kind="values"``: the value head's one output, float32.
    ``keep_logprobs``: a train pass also hands back its log-probs, detached ("logprobs" per micro-batch).
    """

    kind: Literal["logprobs", "values"] = "logprobs"
    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = False
    keep_logprobs: bool = False


# loss_fn(fields, *outputs) -> (numerator, count, {stat: sum}): ``fields`` a micro-batch's per-token fields
# on the outputs' device, ``outputs`` the Head's per-token tensors in order: (log-probs, entropy or None) for
# "logprobs" (rlmega.algorithms.rl_loss's signature), (values,) for "values" (value_loss.critic_loss's).
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


class StepResult(NamedTuple):
    """What an optimizer step did: ``taken`` (the weights moved), the global grad norm before clipping
    (NaN for a skipped step), the LR it used."""

    taken: bool
    grad_norm: float
    lr: float


class TrainEngine(abc.ABC):
    """One model (a policy, a reference or a value model) of one trainer rank, on one backend."""

    PHASE_KINDS: tuple[str, ...] = ()
    """What ``offload`` can move to the host, in the order a colocated trainer releases it ("params" last:
    a weight sync reads them after the rest is gone)."""

    # ---- process and model ------------------------------------------------------------------
    @staticmethod
    @abc.abstractmethod
    def init_process(parallel, seed: int) -> None:
        """Join this backend's process groups (once per process, before any engine is built)."""

    @staticmethod
    @abc.abstractmethod
    def teardown_process() -> None:
        """Leave them (the process may exit or set up again)."""

    @abc.abstractmethod
    def build(self) -> None:
        """The model (weights from model.path, or ``hf_config`` at random) and, with an optimizer, the
        optimizer and LR schedule."""

    vocab_size: int
    """The model's vocabulary (its real size, without padding), once built."""

    # ---- data ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def layout(self) -> Layout:
        """How this engine wants a batch split over its data-parallel ranks (rlmega/data/shards.py)."""

    @abc.abstractmethod
    def dp_rank(self) -> int:
        """This rank's data-parallel rank."""

    def shard(self, data: RolloutBatch | Shard) -> Shard:
        """This rank's share: a Shard the driver planned as it is; a whole batch planned here (every rank
        makes the same plan) and kept whole, the share's micro-batches indexing it."""
        if isinstance(data, Shard):
            return data
        return plan_step(data.lengths(), self.layout()).shard(data, self.dp_rank(), whole=True)

    def micro_batches(self, shard: Shard) -> list[dict]:
        """The shard's packed micro-batches (rlmega.data.micro_batches.build_micro_batch; placeholders for
        [] entries), each at least the plan's shape where it has one."""
        row_multiple = self.layout().row_multiple
        return [
            build_micro_batch(shard.batch, idx, row_multiple=row_multiple, min_shape=shape)
            for idx, shape in zip(shard.micro_batches, shard.shapes)
        ]

    # ---- passes -------------------------------------------------------------------------------

    @abc.abstractmethod
    def forward(self, mbs: list[dict], head: Head, routes=None) -> list[dict] | None:
        """A no-grad pass: per micro-batch the Head's per-token outputs, on the model's device."""

    @abc.abstractmethod
    def forward_backward(
        self, mbs: list[dict], head: Head, loss_fn: LossFn, routes=None
    ) -> list[dict] | None:
        """Forward and backward of every micro-batch (gradients accumulate, normalised over the global
        count once ``optimizer_step`` runs): per micro-batch its loss's sums ("numerator", "count", its
        stats) as float64 on the device, and "logprobs" with ``head.keep_logprobs``."""

    @abc.abstractmethod
    def gather_responses(
        self, mbs: list[dict], outs: list[dict] | None, key: str, shard: Shard
    ) -> list[torch.Tensor]:
        """Per-token outputs ``key`` of this rank's micro-batches -> a float32 (response_len,) per sample of
        the shard's own (``shard.own`` order), on the host, on every rank of this data-parallel rank."""

    @abc.abstractmethod
    def gather_data_parallel(self, shard: Shard, results: list) -> list:
        """Every data-parallel rank's per-sample ``results`` (for its ``shard.samples``) -> one list over the
        whole batch, on every rank (for a caller that gave every rank the whole batch)."""

    @abc.abstractmethod
    def global_sums(self, outs: list[dict] | None, keys: tuple[str, ...]) -> dict[str, float]:
        """Each key's sum over every micro-batch of every rank (float64), the same on every rank."""

    # ---- optimizer ----------------------------------------------------------------------------
    @abc.abstractmethod
    def normalize_grads(self, count: float) -> None:
        """Divide the accumulated gradients by the global ``count`` where the backend has not already."""

    @abc.abstractmethod
    def optimizer_step(self, skip_nonfinite: bool = True, lr: float | None = None) -> StepResult:
        """Clip, step and advance the LR schedule (``lr``: this step only, outside the schedule). A
        non-finite grad norm is global: every rank skips (``skip_nonfinite``) or raises
        FloatingPointError, gradients zeroed."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (a step not taken)."""

    @abc.abstractmethod
    def current_lr(self) -> float:
        """The LR the next scheduled step uses."""

    @abc.abstractmethod
    def advance_lr_schedule(self, steps: int) -> None:
        """Move the schedule on by ``steps`` optimizer steps not taken."""

    # ---- memory -------------------------------------------------------------------------------
    offloaded: dict
    """Kinds now on the host (keys), as ``offload`` named them."""

    @abc.abstractmethod
    def offload(self, kind: str) -> None:
        """Move one of PHASE_KINDS to host memory and give the device its memory back."""

    @abc.abstractmethod
    def onload(self, kind: str) -> None:
        """Bring it back, into the same storages."""

    # ---- state --------------------------------------------------------------------------------
    @abc.abstractmethod
    def save_checkpoint(
        self, root, step: int, extra: dict | None = None, extra_models: dict | None = None
    ):
        """Model, optimizer, schedule, RNG and ``extra`` under root/step_N (written whole, then renamed),
        and ``extra_models`` {name: another engine of this backend} beside them. Returns the path."""

    @abc.abstractmethod
    def load_checkpoint(
        self, root, model_only: bool = False, extra_models: dict | None = None
    ) -> tuple[int, dict]:
        """Restore what ``save_checkpoint`` wrote (root/latest or ``root`` itself): (step, extra). The
        config's optimizer settings win over the saved ones."""

    @abc.abstractmethod
    def saved_models(self, root) -> set[str]:
        """The names of the extra models a checkpoint (root/latest or ``root``) holds."""

    @abc.abstractmethod
    def export_hf(self, out_dir, overwrite: bool = False):
        """The model as a plain Hugging Face folder, written whole, then renamed into place."""

    # ---- weights out --------------------------------------------------------------------------
    @abc.abstractmethod
    def weights_out(self, pieces: bool, weights: str = "merged") -> tuple[bool, Iterator]:
        """(this rank sends, its (HF name, tensor or Piece) in the model's order) for a weight sync. Every
        rank iterates its iterator to the end (it may hold collectives); with ``pieces`` a TP-split tensor
        may come as each TP rank's block (rlmega/sync/pieces.py) instead of gathered whole. ``weights``: a
        model with LoRA adapters sends them merged into its weights ("merged") or its base alone ("base")."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Every trainer rank of this engine's world."""

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters by PEFT's saved names, whole, on every rank, on the host; they may be views of the
        live parameters (copy them to keep them past the next update). Collective. Engines that build no
        adapters refuse it."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapters")

    def adapters_disabled(self):
        """Context: inside, the model computes its base, LoRA adapters off (the reference policy of a LoRA
        run, actor.lora). Engines that build no adapters refuse it."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapters to disable")

    @abc.abstractmethod
    def param_pairs(self, other: "TrainEngine") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this engine's, ``other``'s) local parameter tensors, pairwise: the same parameters of two
        models built alike (the reference and the policy). Refuses models whose parameters differ."""
