"""MegatronActor: the learner on one trainer rank.

Ray (or torchrun) hosts one per rank, and every rank receives the same calls with the same full
RolloutBatch; each data-parallel rank works on its balanced share (packed micro-batches under a
token budget) and every rank returns the same full result.

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
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from contextlib import contextmanager

import torch

from rlmega.algorithms import kl as kl_lib
from rlmega.algorithms import losses
from rlmega.algorithms import rollout_correction as rc_lib
from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.micro_batches import build_micro_batch, scatter_responses
from rlmega.data.packing import padding_efficiency, plan_micro_batches
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.megatron import checkpoint, policy
from rlmega.megatron.hf_io import iter_hf_buckets
from rlmega.megatron.model_manager import MegatronModelManager
from rlmega.megatron.runtime import (barrier, data_parallel_rank_and_size, init_megatron, teardown_megatron,
                                    tensor_parallel_rank)
from rlmega.profiling import TraceRecorder

_STAT_KEYS = ("tokens", "pg_loss", "clipped", "ppo_kl", "entropy", "kl_ref",
              "rc_tokens", "rc_ratio", "rc_truncated", "rc_masked")


def _rollout_correction_metrics(s: dict) -> dict:
    """Token means of the rollout-correction statistics; NaN (unknown) when no token had rollout log-probs."""
    n = s["rc_tokens"]
    if n <= 0:
        return {"rollout_is_ratio": float("nan"), "rollout_is_truncated": float("nan"),
                "rollout_is_masked": float("nan")}
    return {"rollout_is_ratio": s["rc_ratio"] / n, "rollout_is_truncated": s["rc_truncated"] / n,
            "rollout_is_masked": s["rc_masked"] / n}


class MegatronActor:
    def __init__(self, model: ModelConfig, parallel: ParallelismConfig, optimizer: OptimizerConfig,
                 actor: ActorConfig, algorithm: AlgorithmConfig, temperature: float = 1.0,
                 lr_decay_steps: int = 1000, hf_config: dict | None = None, num_threads: int | None = None):
        """``num_threads``: this process's intra-op threads (torch.set_num_threads), set here because
        the actor is built at its process's start (WorkerGroup, torchrun); None leaves them."""
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

    # ---- lifecycle --------------------------------------------------------------------------
    def setup(self, with_reference: bool = True) -> None:
        p = self.parallel
        init_megatron(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.virtual_pipeline_model_parallel_size, seed=self.model_cfg.seed)
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

    def _manager(self) -> MegatronModelManager:
        return MegatronModelManager(self.model_cfg, self.parallel, self.optim_cfg,
                                    lr_decay_steps=self.lr_decay_steps, hf_config=self.hf_config)

    def teardown(self) -> None:
        teardown_megatron()

    # ---- micro-batches ----------------------------------------------------------------------
    def _plan(self, batch: RolloutBatch) -> tuple[list[dict], float]:
        """This DP rank's packed micro-batches, and the padding efficiency of the whole plan."""
        dp_rank, dp = data_parallel_rank_and_size()
        # Megatron's interleaved schedule needs the micro-batch count to be a multiple of PP.
        multiple = self.parallel.pipeline_model_parallel_size if self.policy.vpp > 1 else 1
        # allow_empty: a short batch (fewer samples than ranks) gives a rank placeholders that add
        # nothing to the loss but keep it in the schedule's and the optimizer's collectives
        plan = plan_micro_batches(batch.lengths(), self.cfg.max_tokens_per_micro_batch, dp, multiple_of=multiple,
                                  allow_empty=True)
        thd = self.policy.use_te
        mbs = [build_micro_batch(batch, idx, dense_mask=not thd) for idx in plan[dp_rank]]
        return mbs, padding_efficiency(batch.lengths(), plan, rows=not thd)

    def _gather_responses(self, mbs: list[dict], outs: list[dict] | None, key: str, batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-token values of this rank's samples -> the full batch's per-sample list, on every rank."""
        order = [i for mb in mbs for i in mb["indices"]]
        all_lens = batch.response_lens()  # once: it walks the whole batch
        lens = [all_lens[i] for i in order]
        flat = None
        if outs is not None:
            pieces = {}
            for mb, out in zip(mbs, outs):
                pieces.update(scatter_responses(out[key], mb))
            flat = torch.cat([pieces[i] for i in order]) if order else torch.zeros(0)
        flat = policy.share_from_last_stage(flat, sum(lens)).float()
        mine = dict(zip(order, flat.split(lens)))
        merged = {}
        for part in policy.all_gather_data_parallel(mine):
            merged.update(part)
        return [merged[i] for i in range(len(batch))]

    # ---- forward passes ---------------------------------------------------------------------
    def _logprobs(self, manager: MegatronModelManager, batch: RolloutBatch, with_entropy: bool):
        mbs, _ = self._plan(batch)
        outs = policy.forward_logprobs(manager.model, mbs, self.vocab_size, self.temperature, with_entropy)
        lp = self._gather_responses(mbs, outs, "logprobs", batch)
        ent = self._gather_responses(mbs, outs, "entropy", batch) if with_entropy else None
        return lp, ent

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        """Log-probs (and entropies) of every response token under the current policy."""
        lp, ent = self._logprobs(self.policy, batch, with_entropy)
        return (lp, ent) if with_entropy else lp

    def compute_ref_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        if self.reference is None:
            raise RuntimeError("this actor was set up without a reference policy")
        if self.cfg.offload_reference:
            self.reference.onload_params()
        try:
            return self._logprobs(self.reference, batch, with_entropy=False)[0]
        finally:
            if self.cfg.offload_reference:
                self.reference.offload_params()

    # ---- training ---------------------------------------------------------------------------
    def _loss(self, mb: dict, logprobs: torch.Tensor, entropy: torch.Tensor | None, on_policy: bool = False):
        """The RL loss of one micro-batch. ``on_policy``: the old log-probs are this forward's own,
        detached (see train_step): the PPO ratio is exactly 1 and the clip inactive."""
        a, mask, seq_ids, n = self.algo, mb["loss_mask"], mb["seq_ids"], mb["num_seqs"]
        response_mask = mask  # every response token: the denominator of the token statistics
        old = logprobs.detach() if on_policy else mb["old_logprobs"]  # (T,)
        weight, rc = None, None
        if "rollout_logprobs" in mb:
            weight, keep, rc = rc_lib.correct(a.rollout_correction, old, mb["rollout_logprobs"],
                                              mask, seq_ids, n, a.rollout_is_cap, a.rollout_is_bounds_low,
                                              a.rollout_is_bounds_high)
            if a.rollout_correction in ("mis_token", "mis_seq"):
                mask = mask * keep  # dropped tokens leave every loss term and its denominator (as verl)
        elif a.rollout_correction != "none":
            raise ValueError(f"algorithm.rollout_correction={a.rollout_correction} needs the rollout log-probs "
                             "in the batch (RolloutBatch.rollout_logprobs)")
        if a.policy_loss == "gspo":
            pg, st = losses.gspo(logprobs, old, mb["advantages"], mask, seq_ids, n,
                                 a.clip_eps_low, a.clip_eps_high)
        else:
            pg, st = losses.ppo_clip(logprobs, old, mb["advantages"], mask, a.clip_eps_low,
                                     a.clip_eps_high, a.dual_clip_c if a.policy_loss == "dual_clip" else None)
        if a.rollout_correction == "tis":
            pg = pg * weight  # truncated IS weight, detached: corrects the sampling distribution
        total = pg
        kl_metric = torch.zeros_like(logprobs)
        if "ref_logprobs" in mb:
            if a.kl_coef > 0 and not a.kl_in_reward:
                total = total + a.kl_coef * kl_lib.kl_penalty(logprobs, mb["ref_logprobs"], a.kl_estimator) * mask
            # the metric is always k3's value, the unbiased (>= 0) estimate of KL(pi||ref), whatever
            # estimator the loss uses (k2's value is biased; see rlmega.algorithms.kl)
            kl_metric = kl_lib.kl_penalty(logprobs.detach(), mb["ref_logprobs"], "k3")
        if a.entropy_coef > 0:
            total = total + losses.entropy_bonus(entropy, mask, a.entropy_coef)
        numerator, count = losses.aggregate(total, mask, seq_ids, n, a.loss_agg_mode)
        zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
        stats = {
            "tokens": response_mask.sum(),
            "pg_loss": losses.aggregate(pg.detach(), mask, seq_ids, n, a.loss_agg_mode)[0],
            "clipped": (st["clipped"] * mask).sum(), "ppo_kl": (st["ppo_kl"] * mask).sum(),
            "entropy": (entropy.detach() * response_mask).sum(), "kl_ref": (kl_metric * response_mask).sum(),
            "rc_tokens": response_mask.sum() if rc is not None else zero,
            "rc_ratio": rc["ratio"].sum() if rc is not None else zero,
            "rc_truncated": rc["truncated"].sum() if rc is not None else zero,
            "rc_masked": rc["masked"].sum() if rc is not None else zero,
        }
        return numerator, count, stats

    def _sft_loss(self, mb: dict, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        """Supervised next-token loss on the response tokens (token mean over the batch)."""
        mask = mb["loss_mask"]
        zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
        nll = -(logprobs * mask).sum()
        stats = {"tokens": mask.sum(), "pg_loss": nll.detach(), "clipped": zero, "ppo_kl": zero,
                 "entropy": (entropy.detach() * mask).sum(), "kl_ref": zero,
                 "rc_tokens": zero, "rc_ratio": zero, "rc_truncated": zero, "rc_masked": zero}
        return nll, mask.sum(), stats

    def sft_step(self, batch: RolloutBatch, lr: float | None = None) -> dict:
        """One optimizer step of supervised fine-tuning on the responses (e.g. a warm start).

        ``lr``: a constant learning rate outside the RL schedule (which it neither uses nor advances).
        """
        return self._step(batch, self._sft_loss, temperature=1.0, lr=lr, entropy_grad=False)

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
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages")
        on_policy = batch.old_logprobs is None
        if on_policy and optimizer_steps_per_rl_step != 1:
            raise ValueError(
                "train_step needs batch.old_logprobs (compute_logprobs) unless it is the RL step's only "
                f"optimizer step; it was told optimizer_steps_per_rl_step={optimizer_steps_per_rl_step}: "
                "the steps after the first must compare with the policy before the first, which this "
                "forward no longer is. Pass optimizer_steps_per_rl_step=1 only for a single step.")
        if self.algo.kl_coef > 0 and not self.algo.kl_in_reward and batch.ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs batch.ref_logprobs (compute_ref_logprobs)")
        if self.algo.rollout_correction != "none" and batch.rollout_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction={self.algo.rollout_correction} needs "
                             "batch.rollout_logprobs (the engine's log-probs of the sampled tokens); "
                             "set algorithm.rollout_correction=none for batches without them")
        loss_fn = functools.partial(self._loss, on_policy=on_policy)
        return self._step(batch, loss_fn, self.temperature, entropy_grad=self.algo.entropy_coef > 0,
                          return_logprobs=on_policy)

    def _step(self, batch: RolloutBatch, loss_fn, temperature: float, lr: float | None = None,
              entropy_grad: bool = True, return_logprobs: bool = False) -> dict:
        """One optimizer step. ``entropy_grad``: the loss uses the entropy (else it is a metric only).
        ``return_logprobs``: the result holds this forward's log-probs as "old_logprobs"."""
        if self.cfg.offload_optimizer and "optimizer state" in self.policy.offloaded:
            self.policy.onload_optimizer_state()
        mbs, efficiency = self._plan(batch)
        outs = policy.train_micro_batches(self.policy.model, mbs, self.vocab_size, temperature, loss_fn,
                                          with_entropy=True, entropy_grad=entropy_grad,
                                          keep_logprobs=return_logprobs)
        # collectives (PP broadcast, DP gather) on every rank, before a non-finite loss can raise
        old = self._gather_responses(mbs, outs, "logprobs", batch) if return_logprobs else None
        keys = ("numerator", "count", *_STAT_KEYS)
        sums = None if outs is None else torch.stack([sum(o[k] for o in outs) for k in keys])
        sums = policy.sum_over_data_parallel(policy.share_from_last_stage(sums, len(keys)))
        s = dict(zip(keys, sums.tolist()))
        loss = s["numerator"] / max(s["count"], 1.0)
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
        tokens = max(s["tokens"], 1.0)
        return {
            "loss": loss, "pg_loss": s["pg_loss"] / max(s["count"], 1.0), "pg_clipfrac": s["clipped"] / tokens,
            "ppo_kl": s["ppo_kl"] / tokens, "entropy": s["entropy"] / tokens, "kl_ref": s["kl_ref"] / tokens,
            "grad_norm": grad_norm, "lr": lr, "tokens": int(s["tokens"]), "padding_fraction": 1.0 - efficiency,
            "skipped": 0.0 if ok else 1.0, **_rollout_correction_metrics(s),
            **({"old_logprobs": old} if return_logprobs else {}),
        }

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
                self._polyak(pairs, rate)
        self.reference_moved = True

    def _polyak(self, pairs: list, rate: float) -> None:
        """ref <- (1 - rate) * ref + rate * policy for each (ref, policy) parameter pair, in float32."""
        if self._ref_master is None:
            host = self.cfg.offload_reference  # the reference leaves the device between uses: so does this
            pin = host and torch.cuda.is_available()

            def master_of(r: torch.Tensor) -> torch.Tensor | None:
                if r.dtype == torch.float32:
                    return None
                m = r.detach().to("cpu" if host else r.device, torch.float32, copy=True)
                return m.pin_memory() if pin else m

            self._ref_master = [master_of(r) for r, _ in pairs]
        for (r, p), master in zip(pairs, self._ref_master):
            if master is None:  # float32 parameters: the blend in place is the float32 blend
                r.mul_(1.0 - rate).add_(p, alpha=rate)
                continue
            m = master.to(r.device, non_blocking=True)  # the same tensor when it lives on the device
            m.mul_(1.0 - rate).add_(p.float(), alpha=rate)
            r.copy_(m)  # one rounding to the parameter dtype
            if m is not master:
                master.copy_(m)

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

        Collective: every rank calls it. In data-parallel replica 0, each pipeline stage gathers its
        TP shards one parameter at a time (no rank ever holds the whole model) and its TP rank 0
        sends size-bounded buckets through ``transport``, then flushes it (every bucket loaded).
        The other replicas hold the same weights and skip the gathers: a TP group lies within one
        replica and the gathers are its only collectives (rlmega.megatron.hf_io.iter_hf_tensors).
        Every rank meets at the closing barrier. Returns what this rank did: ``gathered`` HF tensors
        (0 outside replica 0), and sent bytes, tensors, buckets, the (name, shape) list, and seconds.
        """
        tp_rank, dp_rank = tensor_parallel_rank(), data_parallel_rank_and_size()[0]
        sender = tp_rank == 0 and dp_rank == 0
        start = time.perf_counter()
        sent = {"gathered": 0, "bytes": 0, "tensors": 0, "buckets": 0, "names_and_shapes": []}
        if dp_rank == 0:
            for bucket in iter_hf_buckets(self.policy.model, self.policy.shape, bucket_bytes):
                sent["gathered"] += len(bucket)
                if not sender:
                    continue  # the other TP ranks only took part in the gathers
                transport.send(bucket, version)
                sent["buckets"] += 1
                for name, t in bucket:
                    sent["tensors"] += 1
                    sent["bytes"] += t.numel() * t.element_size()
                    sent["names_and_shapes"].append((name, tuple(t.shape)))
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
    # (kind, offload method, onload method) of MegatronModelManager, in offload order.
    _PHASE_KINDS = (("grads", "offload_grads", "onload_grads"),
                    ("optimizer state", "offload_optimizer_state", "onload_optimizer_state"),
                    ("main params", "offload_megatron_copy_params", "load_megatron_copy_params"),
                    ("params", "offload_params", "onload_params"))

    # ---- profiling (logging.profile_steps) --------------------------------------------------
    def start_profile(self) -> None:
        self._trace = TraceRecorder()
        self._trace.start()

    def stop_profile(self, out_dir: str) -> str:
        """Write this rank's trace to ``out_dir/trainer_rank{R}.json``; returns its path."""
        import torch.distributed as dist

        return self._trace.stop(f"{out_dir}/trainer_rank{dist.get_rank()}.json")

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
