"""PolicyActor: the RL learner of one trainer rank, written once over a backend engine.

It implements rlmega.learner.actor_api.Actor (whose docstrings are the contract): the loss composition
(rlmega.algorithms.rl_loss), the non-finite rule, the reference policy and its Polyak update, the step
metrics, the weight-sync bookkeeping and what a checkpoint holds. Everything a backend alone can do is
its engine's (rlmega/learner/engine_api.py): each backend's actor is this class with its engine class
(rlmega/megatron/actor.py: MegatronActor, rlmega/fsdp/actor.py: FSDPActor).

    actor = MegatronActor(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor, cfg.algorithm,
                          temperature=cfg.rollout.temperature)
    actor.setup()                                   # process groups, policy, reference
    old = actor.compute_logprobs(batch)             # list of (response_len,) per sample
    ref = actor.compute_ref_logprobs(batch)
    metrics = actor.train_step(replace(batch, old_logprobs=old, ref_logprobs=ref, advantages=adv))
    actor.update_ref_policy(0.05)

An RL step of one optimizer step needs no separate old-log-prob forward (train_step explains why):

    metrics = actor.train_step(replace(batch, ref_logprobs=ref, advantages=adv), optimizer_steps_per_rl_step=1)
    old = metrics["old_logprobs"]                   # what compute_logprobs would have returned

Backend hooks (no-ops here; MegatronActor's MoE routing replay overrides them): ``_forward_routing``,
``_pass_routes``, ``_forward_done``, ``_train_routing``, ``_train_routes``, ``_train_done``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from contextlib import contextmanager
from typing import Sequence

import torch

from rlmega.learner import lora
from rlmega.learner.actor_api import Actor
from rlmega.algorithms import polyak, rl_loss
from rlmega.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
)
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.shards import Shard
from rlmega.learner.engine_api import Head, StepResult, TrainEngine
from rlmega.sync.stream import stream_weights


class PolicyActor(Actor):
    engine_class: type[TrainEngine]
    """The backend's engine (each backend's subclass sets it)."""

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelismConfig,
        optimizer: OptimizerConfig,
        actor: ActorConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        lr_decay_steps: int = 1000,
        hf_config: dict | None = None,
        num_threads: int | None = None,
        teachers: Sequence[ModelConfig] = (),
        offload_teachers: bool = True,
    ):
        """``num_threads``: this process's intra-op threads (torch.set_num_threads), set here because
        the actor is built at its process's start (WorkerGroup, torchrun); None leaves them. ``teachers``:
        the distillation teachers' models (Actor's docstring)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_cfg, self.parallel, self.optim_cfg = model, parallel, optimizer
        # null clip ranges / aggregation = the policy loss's published default (a copy: the caller's
        # config is left as given)
        algorithm = dataclasses.replace(algorithm).resolve_defaults()
        self.cfg, self.algo, self.temperature = actor, algorithm, temperature
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.policy: TrainEngine | None = None
        self.reference: TrainEngine | None = None
        # LoRA: the reference is the policy with its adapters off (setup)
        self.base_reference = False
        # False once the reference may differ from model.path (a copy after the warm start, a
        # Polyak update, a reference restored from a checkpoint): from then on checkpoints carry it.
        self.reference_moved = False
        # float32 copy of a low-precision reference (update_ref_policy)
        self._ref_master: list | None = None
        self.teacher_cfgs, self.offload_teachers = list(teachers), offload_teachers
        self.teachers: list[TrainEngine] = []  # built at setup, frozen

    # ---- lifecycle --------------------------------------------------------------------------
    def setup(self, with_reference: bool = True) -> None:
        self.engine_class.init_process(self.parallel, self.model_cfg.seed)
        self.policy = self._engine(with_optimizer=True)
        # LoRA (actor.lora): the reference is the policy with its adapters disabled, no second model
        self.base_reference = with_reference and self.cfg.lora.rank > 0
        if with_reference and not self.base_reference:
            self.reference = self._engine(with_optimizer=False)
            if not self.model_cfg.path:  # built from scratch: the reference starts as the policy
                self.update_ref_policy(1.0)
            if self.cfg.offload_reference:
                self.reference.offload("params")
        for teacher in self.teacher_cfgs:
            self.teachers.append(self._engine(with_optimizer=False, model=teacher))
            if self.offload_teachers:
                self.teachers[-1].offload("params")
        self.vocab_size = self.policy.vocab_size

    def _engine(self, with_optimizer: bool, model: ModelConfig | None = None) -> TrainEngine:
        """A built engine of the policy's model (weights from model.path, or ``hf_config`` at random), with
        its optimizer and LR schedule when ``with_optimizer`` (the policy), without (the reference); of
        ``model`` (a teacher's, from its path, without the student's LoRA adapters) when given."""
        actor = (
            self.cfg
            if model is None
            else dataclasses.replace(self.cfg, lora=dataclasses.replace(self.cfg.lora, rank=0))
        )
        engine = self.engine_class(
            model or self.model_cfg,
            self.parallel,
            self.optim_cfg,
            actor,
            with_optimizer=with_optimizer,
            lr_decay_steps=self.lr_decay_steps,
            hf_config=self.hf_config if model is None else None,
        )
        engine.build()
        return engine

    def teardown(self) -> None:
        self.engine_class.teardown_process()

    def data_layout(self):
        """(how the policy wants a batch split, this rank's data-parallel rank): what the driver plans with."""
        return self.policy.layout(), self.policy.dp_rank()

    def _plan(self, batch: RolloutBatch | Shard) -> tuple[list[dict], float]:
        """This data-parallel rank's packed micro-batches of the policy, and the plan's padding efficiency."""
        shard = self.policy.shard(batch)
        return self.policy.micro_batches(shard), shard.efficiency

    @staticmethod
    def _per_sample(
        engine: TrainEngine, mbs: list[dict], outs, key: str, shard: Shard, data
    ) -> list[torch.Tensor]:
        """A pass's per-token ``key`` as per-sample results: the shard's own samples for a Shard, the whole
        batch (gathered over the data-parallel ranks) for a caller that gave every rank all of it."""
        mine = engine.gather_responses(mbs, outs, key, shard)
        return mine if isinstance(data, Shard) else engine.gather_data_parallel(shard, mine)

    # ---- forward passes ---------------------------------------------------------------------
    def _logprobs(
        self,
        engine: TrainEngine,
        data: RolloutBatch | Shard,
        with_entropy: bool,
        replay: bool = False,
        record: bool = False,
    ):
        """(log-probs, entropies or None) per sample under ``engine``'s model. ``replay`` / ``record``: the
        backend's routing of this pass (MoE routing replay, MegatronActor)."""
        shard = engine.shard(data)
        mbs = engine.micro_batches(shard)
        routes = self._pass_routes(engine, shard.batch, mbs, replay, record)
        outs = engine.forward(mbs, Head(temperature=self.temperature, entropy=with_entropy), routes)
        lp = self._per_sample(engine, mbs, outs, "logprobs", shard, data)
        ent = self._per_sample(engine, mbs, outs, "entropy", shard, data) if with_entropy else None
        self._forward_done(engine, routes, shard.batch)
        return lp, ent

    def compute_logprobs(self, batch: RolloutBatch | Shard, with_entropy: bool = False):
        lp, ent = self._logprobs(
            self.policy,
            batch,
            with_entropy,
            *self._forward_routing(_batch_of(batch), "compute_logprobs"),
        )
        return (lp, ent) if with_entropy else lp

    def compute_ref_logprobs(self, batch: RolloutBatch | Shard) -> list[torch.Tensor]:
        replay, _ = self._forward_routing(_batch_of(batch), "compute_ref_logprobs")
        if self.base_reference:
            with self.policy.adapters_disabled():
                return self._logprobs(self.policy, batch, with_entropy=False, replay=replay)[0]
        if self.reference is None:
            raise RuntimeError("this actor was set up without a reference policy")
        with self._reference_onloaded():
            return self._logprobs(self.reference, batch, with_entropy=False, replay=replay)[0]

    def compute_teacher_logprobs(
        self, batch: RolloutBatch | Shard, teacher: int
    ) -> list[torch.Tensor]:
        if not 0 <= teacher < len(self.teachers):
            raise IndexError(f"teacher {teacher}: this actor has {len(self.teachers)} teachers")
        engine = self.teachers[teacher]
        with _onloaded(engine, "params"):  # its own routing (an MoE teacher routes live)
            return self._logprobs(engine, batch, with_entropy=False)[0]

    # ---- training ---------------------------------------------------------------------------
    def sft_step(self, batch: RolloutBatch | Shard, lr: float | None = None) -> dict:
        """One optimizer step of supervised fine-tuning on the responses (e.g. a warm start).

        ``lr``: a constant learning rate outside the RL schedule (which it neither uses nor advances).
        """
        return self._step(batch, rl_loss.sft_loss, Head(temperature=1.0, entropy=True), lr=lr)

    def train_step(
        self, batch: RolloutBatch | Shard, optimizer_steps_per_rl_step: int | None = None
    ) -> dict:
        """One RL optimizer step on the whole batch (needs advantages, and old_logprobs unless on-policy).

        Old log-probs are the policy's before the RL step's first update: the PPO ratio's
        denominator and the rollout-correction weights' numerator. The batch carries them
        (compute_logprobs) unless the caller says this call is the RL step's only optimizer step
        (``optimizer_steps_per_rl_step=1``, only the caller knows how it splits the step). Then
        ``old_logprobs`` may be None: the policy before this update is the one running this very
        forward, so its log-probs, detached, are the old ones (ratio exactly 1; the same numbers
        as a separate no-grad forward, see tests/multiproc/test_actor.py), and the result holds
        them as "old_logprobs": per sample, batch order, on every rank, as compute_logprobs returns.
        """
        # the loss takes values
        settings = {name: getattr(self.algo, name) for name in rl_loss.SETTINGS}
        on_policy = rl_loss.check_train_batch(
            _batch_of(batch), optimizer_steps_per_rl_step, **settings
        )
        loss_fn = functools.partial(rl_loss.rl_loss, on_policy=on_policy, **settings)
        head = Head(
            temperature=self.temperature,
            entropy=True,
            entropy_grad=self.algo.entropy_coef > 0,
            keep_logprobs=on_policy,
        )
        return self._train_metrics(self._step(batch, loss_fn, head, on_policy=on_policy), on_policy)

    def _step(
        self,
        data: RolloutBatch | Shard,
        loss_fn,
        head: Head,
        lr: float | None = None,
        on_policy: bool | None = None,
    ) -> dict:
        """One optimizer step: forward + backward of this rank's micro-batches, the global sums, then the
        step, or a skip (or FloatingPointError) on every rank alike: loss and grad norm are global.
        ``on_policy`` None: not an RL step (the warm start), so no routing replay either."""
        engine = self.policy
        if self.cfg.offload_optimizer and "optimizer state" in engine.offloaded:
            engine.onload("optimizer state")
        shard = engine.shard(data)
        replay = False
        if on_policy is not None:
            batch, replay = self._train_routing(shard.batch, on_policy)
            shard = dataclasses.replace(shard, batch=batch)
        mbs = engine.micro_batches(shard)
        routes, real_mbs = self._train_routes(engine, shard.batch, mbs, replay, loss_fn)
        outs = engine.forward_backward(mbs, head, loss_fn, routes)
        extra = self._train_done(routes, shard.batch, real_mbs)
        # collectives (PP broadcast, DP gather) on every rank, before a non-finite loss can raise
        old = (
            self._per_sample(engine, mbs, outs, "logprobs", shard, data)
            if head.keep_logprobs
            else None
        )
        s = engine.global_sums(outs, rl_loss.SUM_KEYS)
        loss = rl_loss.global_loss(s)
        if math.isfinite(loss):
            engine.normalize_grads(s["count"])
            step = engine.optimizer_step(skip_nonfinite=self.cfg.skip_nonfinite_steps, lr=lr)
        else:
            engine.zero_grad()  # nothing of this step may leak into the next one's gradients
            if not self.cfg.skip_nonfinite_steps:
                raise FloatingPointError(f"non-finite loss {loss}: step not taken")
            step = StepResult(False, float("nan"), engine.current_lr())
        if self.cfg.offload_optimizer:
            engine.offload("optimizer state")
        return {
            **rl_loss.step_metrics(s, shard.efficiency, step.grad_norm, step.lr, step.taken, old),
            **extra,
        }

    def advance_lr_schedule(self, steps: int) -> float:
        """Move the LR schedule on by ``steps`` optimizer steps without taking them; returns the LR now.

        The schedule counts the optimizer steps of full RL steps (Roles.optimizer_steps_per_rl_step);
        a short batch takes fewer (rlmega.step), and this keeps the schedule on the RL-step clock.
        """
        if steps > 0:
            self.policy.advance_lr_schedule(steps)
        return self.policy.current_lr()

    # ---- reference policy ---------------------------------------------------------------------
    @torch.no_grad()
    def update_ref_policy(self, rate: float | None = None) -> None:
        """ref <- (1 - rate) * ref + rate * policy (Polyak); rate 1 copies the policy exactly.

        ``rate`` None uses actor.ref_update_rate (the driver calls it once per RL step).

        The blend runs in float32 on each rank's own parameters (or shards: both models are laid out
        alike). In bf16 (8 significant bits) a step of rate * (policy - ref) below half a unit in the last
        place rounds back to ref, so an in-place bf16 blend would leave the reference where it is for good
        (1% of 1.0 -> 1.05 is 5e-4, under bf16's 3.9e-3 there). A float32 copy of the reference
        (``_ref_master``, rlmega.algorithms.polyak; on the host with actor.offload_reference) carries the
        blend; the bf16 reference is that copy rounded once per update. It starts from the reference
        whenever the reference is replaced (a copy, a checkpoint load) and is not checkpointed: a resumed
        run restarts it from the saved bf16 reference (losing at most half a bf16 unit per element once).
        """
        rate = self.cfg.ref_update_rate if rate is None else rate
        if self.reference is None or rate == 0:
            return
        with self._reference_onloaded():
            pairs = self.reference.param_pairs(self.policy)
            if rate == 1.0:
                for r, p in pairs:
                    r.copy_(p)  # exact, even where the old reference held inf/NaN
                self._ref_master = None  # the reference is the policy, nothing below its precision
            else:
                self._ref_master = polyak.blend(
                    pairs, rate, self._ref_master, host=self.cfg.offload_reference
                )
        self.reference_moved = True

    @contextmanager
    def _reference_onloaded(self):
        with _onloaded(self.reference, "params"):
            yield

    # ---- weights out, checkpoints, export -----------------------------------------------------
    def sync_model_to_rollout(
        self, transport, version: int, bucket_bytes: int = 512 << 20, weights: str = "merged"
    ) -> dict:
        """Stream the policy's weights, in HF names and layout, to the rollout engines: the engine says
        which ranks send and what (``weights_out``: on Megatron each TP rank's own blocks as pieces, or
        whole tensors gathered to TP rank 0 for a transport that cannot take pieces, ``takes_pieces``
        false: CUDA IPC; on FSDP rank 0's full tensors, gathered one at a time); rlmega.sync.stream
        buckets them through ``transport``. Every rank meets at the closing barrier, so every bucket is
        loaded when any rank returns. Returns what this rank did: ``gathered`` tensors, and sent
        bytes, tensors (a piece counts as one), buckets, the (name, shape) list (a piece: its HF tensor's
        whole shape) and seconds. ``weights``: with LoRA adapters, "merged" into the weights, or "base" alone
        (for engines that serve the adapters unmerged: ``adapter_for_rollout``)."""
        start = time.perf_counter()
        sender, tensors = self.policy.weights_out(
            pieces=getattr(transport, "takes_pieces", False), weights=weights
        )
        sent = stream_weights(tensors, transport, version, bucket_bytes, sender)
        self.policy.barrier()  # every stage's buckets are loaded when any rank returns
        sent["seconds"] = time.perf_counter() - start
        return sent

    def adapter_for_rollout(self) -> dict | None:
        """The policy's LoRA adapters as a PEFT adapter folder's files ({name: bytes}) on trainer rank 0, None
        on the others, for engines that serve them unmerged (RolloutWorker.load_adapter). Collective."""
        tensors = self.policy.adapter_tensors()
        return (
            lora.adapter_files(self.cfg.lora, tensors)
            if torch.distributed.get_rank() == 0
            else None
        )

    def put_adapter_for_rollout(self) -> dict | None:
        start = time.perf_counter()
        files = self.adapter_for_rollout()
        if files is None:
            return None
        import ray  # (trainer ranks run on Ray, or torchrun ranks attached to the run's Ray)

        # one copy into the store, read by every engine; returned to the driver instead, the files were copied
        # out of the store there and put back (the same seconds in tools/bench/lora.py at 10 MB, more memory)
        ref = ray.put(files)
        return {
            "ref": ref,
            "bytes": sum(len(b) for b in files.values()),
            "seconds": time.perf_counter() - start,
        }

    def save_checkpoint(self, root, step: int, extra: dict | None = None):
        """Policy, optimizer, schedule, RNG and ``extra``; plus the reference once it has moved away
        from model.path (otherwise resuming rebuilds it from there, and the checkpoint stays half the size)."""
        if self.reference is None or not self.reference_moved:
            return self.policy.save_checkpoint(root, step, extra)
        with self._reference_onloaded():
            return self.policy.save_checkpoint(
                root, step, extra, extra_models={"reference": self.reference}
            )

    def load_checkpoint(self, root, model_only: bool = False):
        """Restore what ``save_checkpoint`` wrote; a saved reference replaces the one from model.path."""
        if self.reference is None or "reference" not in self.policy.saved_models(root):
            return self.policy.load_checkpoint(root, model_only)
        with self._reference_onloaded():
            out = self.policy.load_checkpoint(
                root, model_only, extra_models={"reference": self.reference}
            )
        self.reference_moved = True
        self._ref_master = None  # the Polyak blend restarts from the loaded reference
        return out

    def export_hf(self, out_dir, overwrite: bool = False):
        return self.policy.export_hf(out_dir, overwrite)

    # ---- colocated GPUs: give the device to the rollout engines and take it back --------------
    def offload_for_rollout(self, keep_params: bool = False) -> dict:
        """Move the policy's state to host memory and return the freed memory to the CUDA driver.

        Does nothing unless ``actor.offload_while_generating`` (Roles resolves its None). With
        ``keep_params`` the parameters stay, because a weight sync to the engines still reads them.
        Returns the kinds now on the host and the device bytes still allocated.
        """
        engine = self.policy
        if self.cfg.offload_while_generating:
            for kind in engine.PHASE_KINDS:
                if kind not in engine.offloaded and not (keep_params and kind == "params"):
                    engine.offload(kind)
            if torch.cuda.is_available():
                # the caching allocator would otherwise keep the freed blocks
                torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return {"offloaded": sorted(engine.offloaded), "device_bytes": allocated}

    def onload_for_training(self) -> dict:
        """Bring back what ``offload_for_rollout`` released (the optimizer state stays on the host
        when ``actor.offload_optimizer`` keeps it there between steps: the train step loads it)."""
        engine = self.policy
        for kind in engine.PHASE_KINDS:
            if kind in engine.offloaded and not (
                kind == "optimizer state" and self.cfg.offload_optimizer
            ):
                engine.onload(kind)
        return {"offloaded": sorted(engine.offloaded)}

    # ---- backend hooks (MoE routing replay: MegatronActor) -------------------------------------
    def _forward_routing(self, batch: RolloutBatch, what: str) -> tuple[bool, bool]:
        """(replay, record) of a log-prob pass ``what`` ("compute_logprobs" or "compute_ref_logprobs")."""
        return False, False

    def _pass_routes(
        self, engine: TrainEngine, batch: RolloutBatch, mbs: list[dict], replay: bool, record: bool
    ):
        """The routing a no-grad pass carries to the engine (None: the model's own)."""
        return None

    def _forward_done(self, engine: TrainEngine, routes, batch: RolloutBatch) -> None:
        """After a no-grad pass's gathers (collectives allowed)."""

    def _train_routing(self, batch: RolloutBatch, on_policy: bool) -> tuple[RolloutBatch, bool]:
        """(the batch a train step trains on, whether its pass replays routes)."""
        return batch, False

    def _train_routes(
        self, engine: TrainEngine, batch: RolloutBatch, mbs: list[dict], replay: bool, loss_fn
    ) -> tuple[object, int]:
        """(the routing a train pass carries, the micro-batches with real tokens over every rank)."""
        return None, 0

    def _train_done(self, routes, batch: RolloutBatch, real_mbs: int) -> dict:
        """Metrics of a train pass's routing (collectives allowed: before any non-finite raise)."""
        return {}

    def _train_metrics(self, metrics: dict, on_policy: bool) -> dict:
        """A train step's metrics, completed by the backend."""
        return metrics


@contextmanager
def _onloaded(engine: TrainEngine, kind: str):
    """``engine``'s ``kind`` on its device for the block, offloaded again after if it was before."""
    offloaded = kind in engine.offloaded
    if offloaded:
        engine.onload(kind)
    try:
        yield
    finally:
        if offloaded:
            engine.offload(kind)


def _batch_of(data: RolloutBatch | Shard) -> RolloutBatch:
    """The samples a call carries: a whole batch, or a shard's."""
    return data.batch if isinstance(data, Shard) else data
