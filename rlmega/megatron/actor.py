"""MegatronActor: the learner on one trainer rank, over megatron-core (tensor, pipeline, data parallel).

It implements rlmega.actor_api.Actor (whose docstrings are the contract): Ray (or torchrun) hosts one
per rank, and every rank receives the same calls with the same full RolloutBatch; each data-parallel
rank works on its balanced share (packed micro-batches under a token budget) and every rank returns
the same full result. The losses and metrics are rlmega.algorithms.rl_loss's, shared with FSDPActor.

    actor = MegatronActor(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor, cfg.algorithm,
                          temperature=cfg.rollout.temperature)
    actor.setup()                                   # Megatron groups, policy, reference
    old = actor.compute_logprobs(batch)             # list of (response_len,) per sample
    ref = actor.compute_ref_logprobs(batch)
    metrics = actor.train_step(replace(batch, old_logprobs=old, ref_logprobs=ref, advantages=adv))
    actor.update_ref_policy(0.05)

An RL step of one optimizer step needs no separate old-log-prob forward (train_step explains why):

    metrics = actor.train_step(replace(batch, ref_logprobs=ref, advantages=adv), optimizer_steps_per_rl_step=1)
    old = metrics["old_logprobs"]                   # what compute_logprobs would have returned

MoE models (rlmega.megatron.routing_replay): algorithm.routing_replay=rollout (R3) replays
batch.routed_experts (the engine's routes) in compute_logprobs, compute_ref_logprobs and train_step;
=trainer (R2) records compute_logprobs' routes (by sample id) and replays them in train_step. Tokens
without a route (-1 rows: the last sampled token, tool outputs) are routed live and counted. Metrics,
in train_step's result: router_mismatch (generated (token, MoE layer) pairs whose trainer top-k set
differs from batch.routed_experts, from compute_logprobs' forward: without replay unless R3, where
each layer's router is compared on the replayed input), routes_live_fraction, per-layer expert
load (moe_load_max_over_mean/layer_i, real tokens only) and Megatron's tracked aux / z losses
(moe_load_balancing_loss, moe_z_loss: means over the step's micro-batches with real tokens, all DP ranks,
and MoE layers) when their coefficients are on. The router losses' coefficients are rescaled each
train step (routing_replay.aux_loss_factor) so that actor.moe_aux_loss_coeff / moe_z_loss_coeff weigh
the mean router loss whatever the RL loss divides by; padding stays out of them (padding mask).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from contextlib import contextmanager

import torch

from rlmega.actor_api import Actor
from rlmega.algorithms import polyak, rl_loss
from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.megatron import batching, checkpoint, policy, routing_replay
from rlmega.megatron.hf_io import iter_hf_buckets
from rlmega.megatron.model_manager import PHASE_KINDS, MegatronModelManager
from rlmega.megatron.runtime import (barrier, data_parallel_rank_and_size, init_megatron, teardown_megatron,
                                    tensor_parallel_rank)
from rlmega.sync.pieces import Piece


class MegatronActor(Actor):
    """The Actor interface (rlmega/actor_api.py, its rules included) over megatron-core."""

    def __init__(self, model: ModelConfig, parallel: ParallelismConfig, optimizer: OptimizerConfig,
                 actor: ActorConfig, algorithm: AlgorithmConfig, temperature: float = 1.0,
                 lr_decay_steps: int = 1000, hf_config: dict | None = None, num_threads: int | None = None):
        """``num_threads``: this process's intra-op threads (torch.set_num_threads), set here because
        the actor is built at its process's start (WorkerGroup, torchrun); None leaves them."""
        if actor.activation_checkpointing:  # config validation refuses it too; this covers actors built in code
            raise ValueError("actor.activation_checkpointing=true: the megatron backend does not recompute "
                             "activations; set it to false, or use actor.backend=fsdp")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_cfg, self.parallel, self.optim_cfg = model, parallel, optimizer
        # null clip ranges / aggregation = the policy loss's published default (a copy: the caller's
        # config is left as given)
        algorithm = dataclasses.replace(algorithm).resolve_defaults()
        self.cfg, self.algo, self.temperature = actor, algorithm, temperature
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.policy: MegatronModelManager | None = None
        self.reference: MegatronModelManager | None = None
        # False once the reference may differ from model.path (a copy after the warm start, a
        # Polyak update, a reference restored from a checkpoint): from then on checkpoints carry it.
        self.reference_moved = False
        self._ref_master: list | None = None  # float32 copy of a low-precision reference (update_ref_policy)
        # MoE routing replay (algorithm.routing_replay): none | trainer (R2) | rollout (R3)
        self.routing_replay = getattr(algorithm, "routing_replay", "none") or "none"
        self._routes: dict[int, routing_replay.ModelRoutes] = {}  # id(manager) -> its routers
        self._trainer_routes: dict[int, torch.Tensor] = {}  # R2: sample_id -> (L_i, M, K) of the old forward
        self._route_metrics: dict = {}  # of the last compute_logprobs, reported by the train_steps after it

    # ---- lifecycle --------------------------------------------------------------------------
    def setup(self, with_reference: bool = True) -> None:
        p = self.parallel
        init_megatron(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.virtual_pipeline_model_parallel_size, seed=self.model_cfg.seed,
                      ep=int(getattr(p, "expert_model_parallel_size", 1) or 1))
        self.policy = self._manager()
        self.policy.setup_model_and_optimizer(load_weights=bool(self.model_cfg.path))
        if with_reference:
            self.reference = self._manager()
            self.reference.setup_model_and_optimizer(load_weights=bool(self.model_cfg.path), with_optimizer=False)
            if not self.model_cfg.path:  # built from scratch: the reference starts as the policy
                self.update_ref_policy(1.0)
            if self.cfg.offload_reference:
                self.reference.offload_params()
        self.vocab_size = self.policy.shape.vocab_size
        if self.routing_replay != "none" and not self.policy.shape.is_moe:
            raise ValueError(f"algorithm.routing_replay={self.routing_replay} needs a mixture-of-experts model; "
                             f"{self.policy.shape.architecture} is dense: set it to none")
        # each model's own routers (the reference has its own RouterReplay instances)
        for manager in (self.policy, self.reference):
            if manager is not None and manager.shape.is_moe:
                self._routes[id(manager)] = routing_replay.ModelRoutes(manager.model)

    def _manager(self) -> MegatronModelManager:
        # Routers get megatron's RouterReplay hook on every MoE model, whatever algorithm.routing_replay
        # says: our hook routes live unless told otherwise, and it is what measures router_mismatch
        # (the trainer's own top-k vs the engine's) without replay too.
        return MegatronModelManager(self.model_cfg, self.parallel, self.optim_cfg,
                                    lr_decay_steps=self.lr_decay_steps, hf_config=self.hf_config,
                                    moe_aux_loss_coeff=float(getattr(self.cfg, "moe_aux_loss_coeff", 0.0) or 0.0),
                                    moe_z_loss_coeff=float(getattr(self.cfg, "moe_z_loss_coeff", 0.0) or 0.0),
                                    routing_replay=True)

    def teardown(self) -> None:
        teardown_megatron()

    # ---- micro-batches ----------------------------------------------------------------------
    def _plan(self, batch: RolloutBatch) -> tuple[list[dict], float]:
        """This DP rank's packed micro-batches, and the padding efficiency of the whole plan."""
        return batching.plan(self.policy, batch, self.cfg.max_tokens_per_micro_batch,
                             self.parallel.pipeline_model_parallel_size)

    def _gather_responses(self, mbs: list[dict], outs: list[dict] | None, key: str, batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-token values of this rank's samples -> the full batch's per-sample list, on every rank."""
        return batching.gather_responses(mbs, outs, key, batch)

    # ---- forward passes ---------------------------------------------------------------------
    def _logprobs(self, manager: MegatronModelManager, batch: RolloutBatch, with_entropy: bool,
                  replay: bool = False, record: bool = False):
        """``replay``: the batch's routed_experts replace the routers' choice (-1 rows routed live);
        ``record``: self._trainer_routes gets the routes this forward used, per sample id."""
        if replay:
            self._routes[id(manager)].check(batch.routed_experts)
        mbs, _ = self._plan(batch)
        routes = self._route_pass(manager, mbs, replay, record)
        outs = policy.forward_logprobs(manager.model, mbs, self.vocab_size, self.temperature, with_entropy,
                                       routes=routes)
        lp = self._gather_responses(mbs, outs, "logprobs", batch)
        ent = self._gather_responses(mbs, outs, "entropy", batch) if with_entropy else None
        if routes is not None:
            self._route_metrics = self._route_results(routes, batch)
        return lp, ent

    def _route_pass(self, manager, mbs: list[dict], replay: bool, record: bool):
        """The routing bookkeeping of one pass of an MoE model (None for a dense one)."""
        model_routes = self._routes.get(id(manager))
        if model_routes is None or not model_routes.enabled:
            return None
        return routing_replay.RoutePass(model_routes, manager.model, mbs, replay=replay, record=record)

    def _route_results(self, routes, batch: RolloutBatch) -> dict:
        """Collectives: the pass's routes (when recorded, into self._trainer_routes) and its metrics."""
        if routes.record:
            shape = (routes.routes.num_moe_layers, routes.routes.topk)
            full = routing_replay.gather_routes(routes.recorded_routes(), batch.lengths(), shape)
            self._trainer_routes = dict(zip(batch.sample_ids.tolist(), full))
        counts, load = routing_replay.reduce_counts(routes.counts, routes.load)
        return routing_replay.route_metrics(counts, load)

    def _replays(self, batch: RolloutBatch, what: str) -> bool:
        """R3: the forwards replay the engine's routes, which the batch must then carry."""
        if self.routing_replay != "rollout":
            return False
        if batch.routed_experts is None:
            raise ValueError(f"algorithm.routing_replay=rollout: {what} needs batch.routed_experts (the engine's "
                             "routes; the rollout workers record them when routing replay is rollout)")
        return True

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        """Log-probs (and entropies) of every response token under the current policy.

        MoE: routing_replay=rollout replays batch.routed_experts; =trainer records the routes this
        forward takes, for train_step to replay (by sample id). Its router_mismatch (when the batch has
        engine routes) is what the train_steps after it report; routes_live_fraction and the expert load
        they report are their own forward's.
        """
        replay = self._replays(batch, "compute_logprobs")
        lp, ent = self._logprobs(self.policy, batch, with_entropy, replay=replay,
                                 record=self.routing_replay == "trainer")
        return (lp, ent) if with_entropy else lp

    def compute_ref_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        if self.reference is None:
            raise RuntimeError("this actor was set up without a reference policy")
        if self.cfg.offload_reference:
            self.reference.onload_params()
        try:
            replay = self._replays(batch, "compute_ref_logprobs")
            metrics = self._route_metrics
            try:
                return self._logprobs(self.reference, batch, with_entropy=False, replay=replay)[0]
            finally:
                self._route_metrics = metrics  # the policy's routing metrics are the ones reported
        finally:
            if self.cfg.offload_reference:
                self.reference.offload_params()

    # ---- training ---------------------------------------------------------------------------
    def sft_step(self, batch: RolloutBatch, lr: float | None = None) -> dict:
        """One optimizer step of supervised fine-tuning on the responses (e.g. a warm start).

        ``lr``: a constant learning rate outside the RL schedule (which it neither uses nor advances).
        """
        return self._step(batch, rl_loss.sft_loss, temperature=1.0, lr=lr, entropy_grad=False)

    def train_step(self, batch: RolloutBatch, optimizer_steps_per_rl_step: int | None = None) -> dict:
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
        on_policy = rl_loss.check_train_batch(self.algo, batch, optimizer_steps_per_rl_step)
        loss_fn = functools.partial(rl_loss.rl_loss, self.algo, on_policy=on_policy)
        replay = self._replays(batch, "train_step")
        if self.routing_replay == "trainer" and not on_policy:
            # R2: replay what the old-log-prob forward (compute_logprobs) chose for these samples. On
            # policy, this forward is the old one: its own live routes are the ones to keep.
            missing = [s for s in batch.sample_ids.tolist() if s not in self._trainer_routes]
            if missing:
                raise ValueError(f"algorithm.routing_replay=trainer: samples {missing[:5]} have no routes from "
                                 "compute_logprobs; call it on this batch before train_step")
            batch = dataclasses.replace(batch, routed_experts=[self._trainer_routes[s] for s in batch.sample_ids.tolist()])
            replay = True
        metrics = self._step(batch, loss_fn, self.temperature, entropy_grad=self.algo.entropy_coef > 0,
                             return_logprobs=on_policy, replay=replay)
        # compute_logprobs' router_mismatch (the old forward's, before this RL step's updates) is what
        # every optimizer step of the RL step reports, so rl_step's mean over them is that one value
        # (clearing it after the first let later mini-batches report their own post-update forward's and
        # the mean mixed the two). An on-policy step has no such forward: its own forward's counts stand.
        if on_policy:
            self._route_metrics = {}
        else:
            metrics.update({k: v for k, v in self._route_metrics.items() if k in ("router_mismatch",)})
        return metrics

    def _step(self, batch: RolloutBatch, loss_fn, temperature: float, lr: float | None = None,
              entropy_grad: bool = True, return_logprobs: bool = False, replay: bool = False) -> dict:
        """One optimizer step. ``entropy_grad``: the loss uses the entropy (else it is a metric only).
        ``return_logprobs``: the result holds this forward's log-probs as "old_logprobs".
        ``replay``: the MoE routers replay batch.routed_experts (-1 rows live)."""
        if self.cfg.offload_optimizer and "optimizer state" in self.policy.offloaded:
            self.policy.onload_optimizer_state()
        if replay:
            self._routes[id(self.policy)].check(batch.routed_experts)
        mbs, efficiency = self._plan(batch)
        routes = self._route_pass(self.policy, mbs, replay, record=False)
        real_mbs = 0
        if routes is not None:
            routing_replay.clear_aux_losses()
            routes.aux_factor, real_mbs = self._aux_loss_factor(mbs, loss_fn)
        outs = policy.train_micro_batches(self.policy.model, mbs, self.vocab_size, temperature, loss_fn,
                                          with_entropy=True, entropy_grad=entropy_grad,
                                          keep_logprobs=return_logprobs, routes=routes)
        moe = {}
        if routes is not None:
            moe = self._route_results(routes, batch)
            moe.update(routing_replay.aux_loss_metrics(routes.routes, real_mbs))
        # collectives (PP broadcast, DP gather) on every rank, before a non-finite loss can raise
        old = self._gather_responses(mbs, outs, "logprobs", batch) if return_logprobs else None
        keys = rl_loss.SUM_KEYS
        sums = None if outs is None else torch.stack([sum(o[k] for o in outs) for k in keys])
        sums = policy.sum_over_data_parallel(policy.share_from_last_stage(sums, len(keys)))
        s = dict(zip(keys, sums.tolist()))
        loss = rl_loss.global_loss(s)
        # loss and grad norm are global, so every rank takes the same branch here
        if math.isfinite(loss):
            ok, grad_norm, lr = self.policy.optimizer_step(skip_nonfinite=self.cfg.skip_nonfinite_steps, lr=lr)
        elif self.cfg.skip_nonfinite_steps:
            self.policy.optimizer.zero_grad()
            ok, grad_norm, lr = False, float("nan"), float(self.policy.optimizer.param_groups[0]["lr"])
        else:
            raise FloatingPointError(f"non-finite loss {loss}: step not taken")
        if self.cfg.offload_optimizer:
            self.policy.offload_optimizer_state()
        return {**rl_loss.step_metrics(s, efficiency, grad_norm, lr, ok, old), **moe}

    def _aux_loss_factor(self, mbs: list[dict], loss_fn) -> tuple[float, int]:
        """Collective over DP: (routing_replay.aux_loss_factor of this step, the step's micro-batches with
        real tokens over every DP rank). The RL loss's global count N is the loss function's own count,
        evaluated on each micro-batch's fields before the forward with the old log-probs standing in for
        this forward's (exact off policy; on policy with a mis_token / mis_seq rollout correction, which
        drops tokens by this forward's ratio, it is the count before that drop)."""
        count = real = nonempty = 0.0
        for mb in mbs:
            fields = policy.per_token_on(mb, "cpu")
            T = fields["labels"].numel()
            guess = fields.get("old_logprobs", fields.get("rollout_logprobs", torch.zeros(T)))
            count += float(loss_fn(fields, guess.float(), torch.zeros(T))[1])
            n = float(mb["real_tokens"].sum())
            real += n
            nonempty += float(n > 0)
        count, real, nonempty = policy.sum_over_data_parallel(torch.tensor([count, real, nonempty])).tolist()
        return routing_replay.aux_loss_factor(count, real), int(nonempty)

    def advance_lr_schedule(self, steps: int) -> float:
        """Move the LR schedule on by ``steps`` optimizer steps without taking them; returns the LR now.

        The schedule counts the optimizer steps of full RL steps (Roles.optimizer_steps_per_rl_step);
        a short batch takes fewer (rlmega.step), and this keeps the schedule on the RL-step clock.
        """
        if steps > 0:
            self.policy.scheduler.step(increment=steps)
        return float(self.policy.optimizer.param_groups[0]["lr"])

    # ---- reference policy, checkpoints, export ----------------------------------------------
    @torch.no_grad()
    def update_ref_policy(self, rate: float | None = None) -> None:
        """ref <- (1 - rate) * ref + rate * policy (Polyak); rate 1 copies the policy exactly.

        ``rate`` None uses actor.ref_update_rate (the driver calls it once per RL step).

        The blend runs in float32. In bf16 (8 significant bits) a step of rate * (policy - ref) below
        half a unit in the last place rounds back to ref, so an in-place bf16 blend would leave the
        reference where it is for good (1% of 1.0 -> 1.05 is 5e-4, under bf16's 3.9e-3 there). A
        float32 copy of the reference (``_ref_master``, one per parameter, kept on the reference's
        device, or on the host with actor.offload_reference) carries the blend; the bf16 reference is
        that copy rounded once per update. It starts from the reference whenever the reference is
        replaced (a copy, a checkpoint load) and is not checkpointed: a resumed run restarts it from
        the saved bf16 reference (losing at most half a bf16 unit per element once).
        """
        rate = self.cfg.ref_update_rate if rate is None else rate
        if self.reference is None or rate == 0:
            return
        with self._reference_onloaded():
            pairs = [(r, p) for chunk_ref, chunk in zip(self.reference.unwrapped(), self.policy.unwrapped())
                     for (_, r), (_, p) in zip(chunk_ref.named_parameters(), chunk.named_parameters())]
            if rate == 1.0:
                for r, p in pairs:
                    r.copy_(p)  # exact, even where the old reference held inf/NaN
                self._ref_master = None  # the reference is the policy, nothing below its precision
            else:
                self._ref_master = polyak.blend(pairs, rate, self._ref_master, host=self.cfg.offload_reference)
        self.reference_moved = True

    @contextmanager
    def _reference_onloaded(self):
        offloaded = "params" in self.reference.offloaded
        if offloaded:
            self.reference.onload_params()
        try:
            yield
        finally:
            if offloaded:
                self.reference.offload_params()

    def sync_model_to_rollout(self, transport, version: int, bucket_bytes: int = 512 << 20) -> dict:
        """Stream the policy's weights, in HF names and layout, to the rollout engines.

        Collective: every rank calls it. In data-parallel replica 0, every TP rank of each pipeline
        stage sends its own blocks of the HF tensors (rlmega/sync/pieces.py; replicated tensors from
        TP rank 0) in size-bounded buckets through ``transport``, then flushes it (every bucket
        loaded): nobody gathers, and the engine side places the blocks. A transport that cannot take
        pieces (``takes_pieces`` false: CUDA IPC) gets whole tensors instead: the stage's TP shards
        are gathered to TP rank 0 one parameter at a time (no rank ever holds the whole model), and
        it alone sends.
        The other replicas hold the same weights and skip the gathers: a TP group lies within one
        replica and the gathers, if any, are its only collectives (rlmega.megatron.hf_io.iter_hf_tensors),
        except at expert parallelism > 1, where every rank gathers (an EP group spans DP ranks; with
        DP > EP the EP groups other than the sender's gather for nothing: a known cost, docs/moe.md).
        Every rank meets at the closing barrier. Returns what this rank did: ``gathered`` HF tensors
        or pieces it built (0 outside replica 0; without pieces, TP rank 0 alone: the other TP ranks
        only send their shards to it), and sent bytes, tensors (a piece counts as one), buckets, the
        (name, shape) list (a piece: its HF tensor's whole shape, so every TP rank lists it), and seconds.
        """
        tp_rank, dp_rank = tensor_parallel_rank(), data_parallel_rank_and_size()[0]
        pieces = getattr(transport, "takes_pieces", False)
        sender = dp_rank == 0 and (tp_rank == 0 or pieces)
        start = time.perf_counter()
        sent = {"gathered": 0, "bytes": 0, "tensors": 0, "buckets": 0, "names_and_shapes": []}
        # Expert parallelism splits the experts over data-parallel ranks: replica 0's expert gathers
        # need every EP rank, so with EP > 1 every rank iterates (the dense gathers stay per TP group).
        if sender and hasattr(transport, "begin"):
            transport.begin(version, 0)  # the engines' reloads start while the first bucket is gathered
        if dp_rank == 0 or self.policy.transformer_config.expert_model_parallel_size > 1:
            for bucket in iter_hf_buckets(self.policy.model, self.policy.shape, bucket_bytes, to_first=True,
                                          pieces=pieces):
                sent["gathered"] += len(bucket)
                if not sender:
                    continue  # replica > 0 under EP: it only took part in the expert gathers
                transport.send(bucket, version)
                sent["buckets"] += 1
                for name, t in bucket:
                    sent["tensors"] += 1
                    sent["bytes"] += t.nbytes  # (a piece's: its block's)
                    sent["names_and_shapes"].append((name, tuple(t.full_shape if isinstance(t, Piece) else t.shape)))
            if sender:
                transport.flush()  # a pipelined transport may still be loading the last buckets
        barrier()  # every stage's buckets are loaded when any rank returns
        sent["seconds"] = time.perf_counter() - start
        return sent

    def save_checkpoint(self, root, step: int, extra: dict | None = None):
        """Policy, optimizer, schedule, RNG and ``extra``; plus the reference once it has moved away
        from model.path (otherwise resuming rebuilds it from there, and the checkpoint stays half the size)."""
        if self.reference is None or not self.reference_moved:
            return self.policy.save_checkpoint(root, step, extra)
        with self._reference_onloaded():
            return self.policy.save_checkpoint(root, step, extra, extra_models={"reference": self.reference.model})

    def load_checkpoint(self, root, model_only: bool = False):
        """Restore what ``save_checkpoint`` wrote; a saved reference replaces the one from model.path."""
        path = checkpoint.latest(root) or root
        if self.reference is None or "reference" not in checkpoint.saved_models(path):
            return self.policy.load_checkpoint(path, model_only)
        with self._reference_onloaded():
            out = self.policy.load_checkpoint(path, model_only, extra_models={"reference": self.reference.model})
        self.reference_moved = True
        self._ref_master = None  # the Polyak blend restarts from the loaded reference
        return out

    def export_hf(self, out_dir, overwrite: bool = False):
        return self.policy.export_hf(out_dir, overwrite)

    # ---- colocated GPUs: give the device to the rollout engines and take it back --------------
    _PHASE_KINDS = PHASE_KINDS

    def offload_for_rollout(self, keep_params: bool = False) -> dict:
        """Move the policy's state to host memory and return the freed memory to the CUDA driver.

        Does nothing unless ``actor.offload_while_generating`` (Roles resolves its None). With
        ``keep_params`` the parameters stay, because a weight sync to the engines still reads them.
        Returns the kinds now on the host and the device bytes still allocated.
        """
        if self.cfg.offload_while_generating:
            for kind, offload_fn, _ in self._PHASE_KINDS:
                if kind not in self.policy.offloaded and not (keep_params and kind == "params"):
                    getattr(self.policy, offload_fn)()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the caching allocator would otherwise keep the freed blocks
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return {"offloaded": sorted(self.policy.offloaded), "device_bytes": allocated}

    def onload_for_training(self) -> dict:
        """Bring back what ``offload_for_rollout`` released (the optimizer state stays on the host
        when ``actor.offload_optimizer`` keeps it there between steps: the train step loads it)."""
        for kind, _, onload_fn in self._PHASE_KINDS:
            if kind in self.policy.offloaded and not (kind == "optimizer state" and self.cfg.offload_optimizer):
                getattr(self.policy, onload_fn)()
        return {"offloaded": sorted(self.policy.offloaded)}
