"""FSDPActor: the learner on one trainer rank, torch FSDP2 over any Hugging Face causal LM.

The same interface and the same numbers as MegatronActor (rlmega.actor_api.Actor is the contract);
all ranks are data-parallel and each holds a shard of every parameter (FSDPModelManager).

    actor = FSDPActor(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor, cfg.algorithm,
                      temperature=cfg.rollout.temperature)
    actor.init_worker()                     # = setup(): process group, policy, reference
    old = actor.compute_logprobs(batch)     # list of (response_len,) per sample, every rank
    metrics = actor.train_step(replace(batch, old_logprobs=old, advantages=adv))

How a step maps onto FSDP2:
- Every rank plans the whole batch the same way (packing.plan_micro_batches, balanced by tokens) and
  runs its share. Each forward all-gathers the parameters, so every rank runs the SAME number of
  micro-batches: a rank with fewer gets placeholders (build_micro_batch(batch, []): zero loss mask).
- Gradients are reduced only on the last micro-batch (manager.before_micro_batch).
- Global normalisation (Megatron's calculate_per_token_loss): each micro-batch back-propagates its
  loss numerator; numerators and counts are summed over micro-batches and ranks; the sharded
  gradients are then multiplied by world_size / global_count (FSDP2's reduce-scatter averages over
  ranks, i.e. divides by world_size), so the gradient is exactly d(sum numerators)/d(theta) / count,
  the single-process one, before clipping and the optimizer step. The count is only known after the
  forwards (rollout correction may drop tokens by the forward's own log-probs), hence after, not before.
- The HF model trains as Megatron's mapping does: dropout off (train mode kept for activation
  checkpointing) and the pad token's embedding row trained (HF's padding_idx would freeze it).
- After a no-grad forward the root's parameters are resharded (FSDP2 keeps them whole otherwise).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rlmega.actor_api import Actor
from rlmega.algorithms import polyak, rl_loss
from rlmega.checkpoint_files import resolve
from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.micro_batches import build_micro_batch, scatter_responses
from rlmega.data.packing import padding_efficiency, plan_micro_batches
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.fsdp.checkpoint import read_meta
from rlmega.fsdp.forward import micro_batch_logprobs
from rlmega.fsdp.model_manager import FSDPModelManager, local_shard
from rlmega.distributed import init_distributed


def _reshard(model) -> None:
    """Back to sharded parameters. FSDP2 keeps the ROOT module's parameters unsharded after a forward
    (its backward would gather them again at once); after a no-grad forward no backward comes, so
    they would stay whole: full-size memory, and parameters that no longer pair with the other
    model's shards (the Polyak update) or with the optimizer's."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _no_dropout(model: torch.nn.Module) -> None:
    """Dropout off, as Megatron's mapping sets it (hidden and attention dropout 0): a log-prob must be
    a function of the weights (the PPO ratio's old and new, parity with the engine). The model stays
    in train mode, which HF's activation checkpointing needs."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0  # HF attention modules pass it to sdpa in train mode


class FSDPActor(Actor):
    def __init__(self, model: ModelConfig, parallel: ParallelismConfig, optimizer: OptimizerConfig,
                 actor: ActorConfig, algorithm: AlgorithmConfig, temperature: float = 1.0,
                 lr_decay_steps: int = 1000, hf_config: dict | None = None, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_cfg, self.parallel, self.optim_cfg = model, parallel, optimizer
        algorithm = dataclasses.replace(algorithm).resolve_defaults()  # a copy: the caller's stays as given
        self.cfg, self.algo, self.temperature = actor, algorithm, temperature
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.policy: FSDPModelManager | None = None
        self.reference: FSDPModelManager | None = None
        self.reference_moved = False
        self._ref_master: list | None = None  # float32 copy of a low-precision reference (polyak.blend)
        self.global_step = 0
        self.rank, self.world_size = 0, 1

    # ---- lifecycle (RLinf: init_worker, model_provider_func, set_global_step) -----------------
    def init_worker(self, with_reference: bool = True) -> None:
        """Join the process group, build the policy with optimizer and schedule, and the reference."""
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.parallel.world_size != self.world_size:
            raise ValueError(f"parallelism.world_size={self.parallel.world_size} but {self.world_size} ranks "
                             "were started; fix: set parallelism.world_size to the number of trainer ranks")
        self.policy = self.model_provider_func(with_optimizer=True)
        if with_reference:
            self.reference = self.model_provider_func(with_optimizer=False)
            if not self.model_cfg.path:  # built from scratch: the reference starts as the policy
                self.update_ref_policy(1.0)
            if self.cfg.offload_reference:
                self.reference.offload_param_and_grad()
        self.vocab_size = int(self.policy.model.config.vocab_size)

    def setup(self, with_reference: bool = True) -> None:
        self.init_worker(with_reference)

    def model_provider_func(self, with_optimizer: bool = True) -> FSDPModelManager:
        """A sharded model (weights from model.path, or ``hf_config`` at random), with an optimizer
        and LR schedule when ``with_optimizer`` (the policy), without (the reference)."""
        mm = FSDPModelManager(self.model_cfg, self.optim_cfg, self.cfg, self.world_size, self.rank,
                              lr_decay_steps=self.lr_decay_steps, hf_config=self.hf_config)
        mm.setup_model_and_optimizer(with_optimizer=with_optimizer)
        # HF builds the input embedding with padding_idx=config.pad_token_id, which zeroes that row's
        # gradient. A sampled sequence may hold the pad token (Qwen's pad is <|endoftext|>); Megatron
        # (and the gradient of the loss) trains its row like any other, so this backend does too.
        # padding_idx only acts in the backward: the forward is unchanged.
        emb = mm.model.get_input_embeddings()
        if getattr(emb, "padding_idx", None) is not None:
            emb.padding_idx = None
        _no_dropout(mm.model)
        return mm

    def set_global_step(self, global_step: int) -> None:
        """The trainer's RL step, for what is named by it (profiles); the LR schedule keeps its own count."""
        self.global_step = int(global_step)

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- micro-batches ------------------------------------------------------------------------
    def _plan(self, batch: RolloutBatch) -> tuple[list[dict], float]:
        """This rank's packed one-row micro-batches, padded with placeholders to the largest rank's
        count (every rank must run the same forwards: each one all-gathers), and the plan's efficiency."""
        lengths = batch.lengths()
        plan = plan_micro_batches(lengths, self.cfg.max_tokens_per_micro_batch, self.world_size, allow_empty=True)
        n = max(len(p) for p in plan)
        plan = [p + [[] for _ in range(n - len(p))] for p in plan]
        mbs = [build_micro_batch(batch, idx) for idx in plan[self.rank]]
        return mbs, padding_efficiency(lengths, plan)

    def _all_gather(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise float64 sum over ranks, on the host (through the device on NCCL)."""
        if dist.get_backend() == "nccl":
            values = values.cuda()
        dist.all_reduce(values)
        return values.cpu()

    def _gather_responses(self, mbs: list[dict], per_mb: list[torch.Tensor], batch: RolloutBatch) -> list[torch.Tensor]:
        """Per-token values (one (T,) per micro-batch of this rank) -> the full batch's per-sample
        list (float32, host, batch order), on every rank."""
        mine = {}
        for mb, values in zip(mbs, per_mb):
            mine.update({i: v.detach().float().cpu() for i, v in scatter_responses(values, mb).items()})
        merged = {}
        for part in self._all_gather(mine):
            merged.update(part)
        return [merged[i] for i in range(len(batch))]

    # ---- forward passes -----------------------------------------------------------------------
    @torch.no_grad()
    def _logprobs(self, manager: FSDPModelManager, batch: RolloutBatch, with_entropy: bool):
        mbs, _ = self._plan(batch)
        lps, ents = [], []
        for mb in mbs:
            lp, ent = micro_batch_logprobs(manager.model, mb, self.temperature, with_entropy)
            lps.append(lp)
            ents.append(ent)
        _reshard(manager.model)
        lp = self._gather_responses(mbs, lps, batch)
        ent = self._gather_responses(mbs, ents, batch) if with_entropy else None
        return lp, ent

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        lp, ent = self._logprobs(self.policy, batch, with_entropy)
        return (lp, ent) if with_entropy else lp

    def compute_ref_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        if self.reference is None:
            raise RuntimeError("this actor was set up without a reference policy")
        with self._reference_onloaded():
            return self._logprobs(self.reference, batch, with_entropy=False)[0]

    # ---- training -----------------------------------------------------------------------------
    def sft_step(self, batch: RolloutBatch, lr: float | None = None) -> dict:
        return self._step(batch, rl_loss.sft_loss, temperature=1.0, lr=lr, entropy_grad=False)

    def train_step(self, batch: RolloutBatch, optimizer_steps_per_rl_step: int | None = None) -> dict:
        on_policy = rl_loss.check_train_batch(self.algo, batch, optimizer_steps_per_rl_step)
        loss_fn = functools.partial(rl_loss.rl_loss, self.algo, on_policy=on_policy)
        return self._step(batch, loss_fn, self.temperature, entropy_grad=self.algo.entropy_coef > 0,
                          return_logprobs=on_policy)

    def _step(self, batch: RolloutBatch, loss_fn, temperature: float, lr: float | None = None,
              entropy_grad: bool = True, return_logprobs: bool = False) -> dict:
        """One optimizer step: forward + backward of this rank's micro-batches, global sums, the
        gradient scaled to the global normalisation, then clip + step (or a skip on every rank)."""
        pm = self.policy
        if self.cfg.offload_optimizer and "optimizer state" in pm.offloaded:
            pm.load_optimizer(self._device())
        mbs, efficiency = self._plan(batch)
        model = pm.model
        device = self._device()
        sums = torch.zeros(len(rl_loss.SUM_KEYS), dtype=torch.float64, device=device)
        kept = []
        for k, mb in enumerate(mbs):
            pm.before_micro_batch(model, is_last_micro_batch=k == len(mbs) - 1)
            fields = {key: v.to(device) if torch.is_tensor(v) and v.dim() == 1 else v for key, v in mb.items()}
            lp, ent = micro_batch_logprobs(model, fields, temperature, with_entropy=True, entropy_grad=entropy_grad)
            numerator, count, stats = loss_fn(fields, lp, ent)
            if not numerator.requires_grad:  # e.g. nothing of the loss depends on the weights: still run
                numerator = numerator + lp.sum() * 0.0  # the backward, whose reduce-scatter every rank joins
            numerator.backward()
            sums += torch.stack([numerator.detach().double(), count.detach().double(),
                                 *[torch.as_tensor(stats[key], device=device).double() for key in rl_loss.STAT_KEYS]])
            if return_logprobs:
                kept.append(lp.detach())
        # collectives on every rank, before a non-finite loss can raise
        old = self._gather_responses(mbs, kept, batch) if return_logprobs else None
        s = dict(zip(rl_loss.SUM_KEYS, self._all_reduce_sum(sums.cpu()).tolist()))
        loss = rl_loss.global_loss(s)
        if math.isfinite(loss):
            self._scale_grads(self.world_size / max(s["count"], 1.0))
            grad_norm, lrs = pm.optimizer_step(skip_nonfinite=self.cfg.skip_nonfinite_steps, lr=lr)
            grad_norm, lr, ok = float(grad_norm), float(lrs[0]), math.isfinite(float(grad_norm))
        elif self.cfg.skip_nonfinite_steps:
            pm.optimizer.zero_grad(set_to_none=True)
            ok, grad_norm, lr = False, float("nan"), float(pm.optimizer.param_groups[0]["lr"])
        else:
            pm.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite loss {loss}: step not taken")
        if self.cfg.offload_optimizer:
            pm.offload_optimizer()
        return rl_loss.step_metrics(s, efficiency, grad_norm, lr, ok, old)

    @torch.no_grad()
    def _scale_grads(self, scale: float) -> None:
        """Sharded gradients *= scale (local shards: no communication)."""
        if scale == 1.0:
            return
        for p in self.policy.model.parameters():
            if p.grad is not None:
                local_shard(p.grad).mul_(scale)

    def _device(self) -> torch.device:
        return self.policy.device

    def advance_lr_schedule(self, steps: int) -> float:
        if steps > 0:
            self.policy.advance_lr_schedule(steps)
        return float(self.policy.optimizer.param_groups[0]["lr"])

    # ---- reference policy ---------------------------------------------------------------------
    @torch.no_grad()
    def update_ref_policy(self, rate: float | None = None) -> None:
        """ref <- (1 - rate) * ref + rate * policy on each rank's shards (same sharding), float32
        (rlmega.algorithms.polyak); rate 1 copies exactly."""
        rate = self.cfg.ref_update_rate if rate is None else rate
        if self.reference is None or rate == 0:
            return
        with self._reference_onloaded():
            ref_named = list(self.reference.model.named_parameters())
            pol_named = list(self.policy.model.named_parameters())
            if [n for n, _ in ref_named] != [n for n, _ in pol_named]:
                raise RuntimeError("reference and policy parameters differ: they must be built from one config")
            pairs = [(local_shard(r), local_shard(p)) for (_, r), (_, p) in zip(ref_named, pol_named)]
            if rate == 1.0:
                for r, p in pairs:
                    r.copy_(p)  # exact, even where the old reference held inf/NaN
                self._ref_master = None
            else:
                self._ref_master = polyak.blend(pairs, rate, self._ref_master, host=self.cfg.offload_reference)
        self.reference_moved = True

    @contextmanager
    def _reference_onloaded(self):
        offloaded = bool(self.reference.offloaded)
        if offloaded:
            self.reference.load_param_and_grad(self._device())
        try:
            yield
        finally:
            if offloaded:
                self.reference.offload_param_and_grad()

    # ---- weights out --------------------------------------------------------------------------
    def sync_model_to_rollout(self, transport, version: int, bucket_bytes: int = 512 << 20) -> dict:
        """Stream the policy's full HF tensors in buckets of at most ``bucket_bytes`` (a bigger tensor
        goes alone). Every rank takes part in each parameter's all-gather (manager.iter_full_tensors,
        one at a time, so only the bucket being filled is held in full); rank 0 sends and flushes."""
        sender = self.rank == 0
        start = time.perf_counter()
        sent = {"gathered": 0, "bytes": 0, "tensors": 0, "buckets": 0, "names_and_shapes": []}

        def send(bucket):
            transport.send(bucket, version)
            sent["buckets"] += 1
            for name, t in bucket:
                sent["tensors"] += 1
                sent["bytes"] += t.numel() * t.element_size()
                sent["names_and_shapes"].append((name, tuple(t.shape)))

        if sender and hasattr(transport, "begin"):
            transport.begin(version, 0)  # the engines' reloads start while the first bucket is gathered
        bucket, size = [], 0
        for name, value in self.policy.iter_full_tensors():
            sent["gathered"] += 1
            if not sender:
                continue  # the other ranks only took part in the gather
            nbytes = value.numel() * value.element_size()
            if bucket and size + nbytes > bucket_bytes:
                send(bucket)
                bucket, size = [], 0
            bucket.append((name, value))
            size += nbytes
        if sender:
            if bucket:
                send(bucket)
            transport.flush()  # a pipelined transport may still be loading the last buckets
        dist.barrier()  # every bucket is loaded when any rank returns
        sent["seconds"] = time.perf_counter() - start
        return sent

    def save_checkpoint(self, root, step: int, extra: dict | None = None):
        if self.reference is None or not self.reference_moved:
            return self.policy.save_checkpoint(root, step, extra)
        with self._reference_onloaded():
            return self.policy.save_checkpoint(root, step, extra, extra_models={"reference": self.reference.model})

    def load_checkpoint(self, root, model_only: bool = False):
        saved = read_meta(resolve(root))["extra_models"]
        if self.reference is None or "reference" not in saved:
            return self.policy.load_checkpoint(root, model_only)
        with self._reference_onloaded():
            out = self.policy.load_checkpoint(root, model_only, extra_models={"reference": self.reference.model})
        self.reference_moved = True
        self._ref_master = None  # the Polyak blend restarts from the loaded reference
        return out

    def export_hf(self, out_dir, overwrite: bool = False):
        return self.policy.export_hf(out_dir, overwrite)

    # ---- colocated GPUs -----------------------------------------------------------------------
    def offload_for_rollout(self, keep_params: bool = False) -> dict:
        """Kinds (FSDPModelManager.offloaded): "optimizer state", then "params" and "grads" together
        unless ``keep_params``. Between steps the gradients are None (the step zeroes them to None),
        so they hold no memory while the parameters stay; there is no separate fp32 copy to release
        (the sharded parameters are the optimizer's float32 master weights)."""
        pm = self.policy
        if self.cfg.offload_while_generating:
            if "optimizer state" not in pm.offloaded:
                pm.offload_optimizer()
            if not keep_params and "params" not in pm.offloaded:
                pm.offload_param_and_grad(offload_grad=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return {"offloaded": sorted(pm.offloaded), "device_bytes": allocated}

    def onload_for_training(self) -> dict:
        pm = self.policy
        if "params" in pm.offloaded:
            pm.load_param_and_grad(self._device(), load_grad=True)
        if "optimizer state" in pm.offloaded and not self.cfg.offload_optimizer:
            pm.load_optimizer(self._device())
        return {"offloaded": sorted(pm.offloaded)}

    # profiling (start_profile / stop_profile): rlmega.actor_api.Actor's, the same for every backend
