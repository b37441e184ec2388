"""FSDPCritic: the value model of PPO (algorithm.advantage_estimator=gae) on torch FSDP2 trainer ranks.

The policy's architecture as transformers' ``AutoModelForTokenClassification`` with one label, no bias
and no dropout (rlmega/config/value_model.py): the HF body and ``score`` (hidden -> 1). It is sharded,
optimised, checkpointed and offloaded exactly as FSDPActor's policy (an FSDPModelManager whose
``model_provider_func`` builds the value model), and runs through the same packed micro-batches: the
head's output at position p is the value of the state before the token at p + 1, so the values sit on
the log-probs' prediction positions and ``scatter_responses`` hands each sample its (response_len,).

    critic = FSDPCritic(**critic_kwargs(cfg))   # rlmega.critic_api; in each trainer rank's process
    critic.setup()                              # process group, value model, AdamW, LR schedule
    old = critic.compute_values(batch)          # list of (response_len,) float32, every rank
    metrics = critic.train_step(replace(batch, returns=ret, old_values=old))

Where the weights come from (model.path): a critic's export (``XForTokenClassification``) loads whole;
a causal LM (the policy) gives its body (``model.*``, its LM head unused) and the head starts from
``fresh_value_head(hidden, head_std, model.seed)``, the draw the Megatron critic starts from too;
``hf_config`` (a causal LM's config dict) builds a random body seeded by model.seed, and the same head.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from rlmega.algorithms import losses
from rlmega.algorithms.value_loss import SUM_KEYS, STAT_KEYS, critic_loss, critic_metrics
from rlmega.config.schema import ActorConfig, CriticConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.config.value_model import VALUE_HEAD, fresh_value_head, head_std, is_value_model, value_model_config
from rlmega.critic_api import Critic
from rlmega.data.micro_batches import build_micro_batch, scatter_responses
from rlmega.data.packing import plan_micro_batches
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.distributed import init_distributed
from rlmega.fsdp import packed_attention
from rlmega.fsdp.actor import _no_dropout, _reshard
from rlmega.fsdp.forward import forward_logits
from rlmega.fsdp.model_manager import FSDPModelManager, local_shard


class ValueModelManager(FSDPModelManager):
    """FSDPModelManager over the value model: only the model it builds (and exports) differs."""

    AUTO_CLASS = "AutoModelForTokenClassification"

    def model_provider_func(self) -> torch.nn.Module:
        """The full value model on the CPU in float32 (master weights; bf16 is FSDP's compute cast),
        with the packed attention of the policy's (FSDPModelManager.model_provider_func)."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        kw = {"dtype": torch.float32, "attn_implementation": packed_attention.NAME}
        source = dict(self.hf_config) if self.hf_config is not None else \
            json.loads((Path(self.model_cfg.path) / "config.json").read_text())
        hf = value_model_config(source)
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        if self.hf_config is not None:
            with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left where it was
                torch.manual_seed(self.model_cfg.seed)
                model = AutoModelForTokenClassification.from_config(config, **kw)
        else:
            # A causal LM's checkpoint fills the body (the same "model." prefix); its lm_head is left out.
            model, info = AutoModelForTokenClassification.from_pretrained(
                self.model_cfg.path, config=config, local_files_only=True, output_loading_info=True, **kw)
            fresh = set() if is_value_model(source) else {VALUE_HEAD}  # a policy has no value head to load
            missing = set(info["missing_keys"]) - fresh
            if missing:  # transformers would have left them at random init without a word beyond a warning
                raise RuntimeError(f"{self.model_cfg.path}: the value model's {sorted(missing)} are not in its "
                                   "checkpoint")
            if is_value_model(source):
                return model  # a critic's export: its own head
        hidden = config.get_text_config().hidden_size
        with torch.no_grad():  # not transformers' init: the seeded draw both backends share
            model.score.weight.copy_(fresh_value_head(hidden, head_std(source), self.model_cfg.seed))
        return model


class FSDPCritic(Critic):
    def __init__(self, model: ModelConfig, parallel: ParallelismConfig, optimizer: OptimizerConfig,
                 critic: CriticConfig, max_tokens_per_micro_batch: int = 2048, loss_agg_mode: str = "token-mean",
                 lr_decay_steps: int = 1000, hf_config: dict | None = None, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if loss_agg_mode not in losses.AGGREGATIONS:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r}; valid: {', '.join(losses.AGGREGATIONS)}")
        self.model_cfg, self.parallel, self.optim_cfg, self.cfg = model, parallel, optimizer, critic
        self.max_tokens, self.loss_agg_mode = max_tokens_per_micro_batch, loss_agg_mode
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.manager: ValueModelManager | None = None
        self.rank, self.world_size = 0, 1

    # ---- lifecycle ----------------------------------------------------------------------------
    def setup(self) -> None:
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.parallel.world_size != self.world_size:
            raise ValueError(f"critic parallelism.world_size={self.parallel.world_size} but {self.world_size} ranks "
                             "were started; fix: set critic.parallelism (or parallelism).world_size to the rank count")
        # The manager reads only activation_checkpointing from an ActorConfig; the critic runs without it.
        mm = ValueModelManager(self.model_cfg, self.optim_cfg, ActorConfig(), self.world_size, self.rank,
                               lr_decay_steps=self.lr_decay_steps, hf_config=self.hf_config)
        mm.setup_model_and_optimizer(with_optimizer=True)
        emb = mm.model.get_input_embeddings()
        if getattr(emb, "padding_idx", None) is not None:
            emb.padding_idx = None  # the pad token's row trains like any other (FSDPActor.model_provider_func)
        _no_dropout(mm.model)  # a value is a function of the weights: old and new values comparable
        self.manager = mm

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- micro-batches (FSDPActor's plan: same forwards on every rank, placeholders fill) -----
    def _plan(self, batch: RolloutBatch) -> list[dict]:
        """This rank's packed one-row micro-batches, padded with placeholders to the largest rank's count
        (each forward all-gathers, so every rank runs the same number)."""
        plan = plan_micro_batches(batch.lengths(), self.max_tokens, self.world_size, allow_empty=True)
        mine = plan[self.rank] + [[]] * (max(len(p) for p in plan) - len(plan[self.rank]))
        return [build_micro_batch(batch, idx) for idx in mine]

    def _values(self, mb: dict) -> torch.Tensor:
        """(T,) float32: the head's one output at every position of a one-row packed micro-batch."""
        return forward_logits(self.manager.model, mb)[:, 0].float()  # (T, 1) -> (T,)

    def _gather_responses(self, mbs: list[dict], per_mb: list[torch.Tensor], batch: RolloutBatch) -> list:
        """Per-token values (one (T,) per micro-batch of this rank) -> the batch's per-sample list
        (float32, host, batch order), on every rank."""
        mine = {}
        for mb, values in zip(mbs, per_mb):
            mine.update({i: v.detach().float().cpu() for i, v in scatter_responses(values, mb).items()})
        parts = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        merged = {i: v for part in parts for i, v in part.items()}
        return [merged[i] for i in range(len(batch))]

    # ---- values and training ------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> list[torch.Tensor]:
        mbs = self._plan(batch)
        per_mb = [self._values(mb) for mb in mbs]
        _reshard(self.manager.model)  # no backward follows: free the root's gathered parameters
        return self._gather_responses(mbs, per_mb, batch)

    def train_step(self, batch: RolloutBatch) -> dict:
        """Each micro-batch back-propagates its loss numerator; numerators, counts and statistics are
        summed over micro-batches and ranks, and the sharded gradients multiplied by world / count
        (FSDP2's reduce-scatter averages over ranks): the gradient of the global batch's loss, whatever
        the layout or token budget (FSDPActor._step's normalisation). A non-finite loss or gradient norm
        skips the step on every rank (the sums and the norm are global, so every rank decides alike)."""
        if batch.returns is None:
            raise ValueError("critic train_step needs batch.returns (the GAE returns, rlmega.algorithms.gae)")
        pm = self.manager
        device = pm.device
        mbs = self._plan(batch)
        sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=device)
        for k, mb in enumerate(mbs):
            pm.before_micro_batch(pm.model, is_last_micro_batch=k == len(mbs) - 1)
            fields = {key: v.to(device) if torch.is_tensor(v) and v.dim() == 1 else v for key, v in mb.items()}
            numerator, count, stats = critic_loss(fields, self._values(fields), self.cfg.cliprange_value,
                                                  self.loss_agg_mode)
            numerator.backward()  # a placeholder's numerator is 0 but still a graph: its reduce-scatter runs
            sums += torch.stack([numerator.detach().double(), count.detach().double(),
                                 *[torch.as_tensor(stats[key], device=device).double() for key in STAT_KEYS]])
        dist.all_reduce(sums)  # on the manager's device: the GPU under nccl, the host under gloo
        s = dict(zip(SUM_KEYS, sums.cpu().tolist()))
        if math.isfinite(s["numerator"] / max(s["count"], 1.0)):
            self._scale_grads(self.world_size / max(s["count"], 1.0))
            grad_norm, lrs = pm.optimizer_step(skip_nonfinite=True)
            grad_norm, lr, ok = float(grad_norm), float(lrs[0]), math.isfinite(float(grad_norm))
        else:
            pm.optimizer.zero_grad(set_to_none=True)
            grad_norm, lr, ok = float("nan"), float(pm.optimizer.param_groups[0]["lr"]), False
        return critic_metrics(s, grad_norm, lr, ok)

    @torch.no_grad()
    def _scale_grads(self, scale: float) -> None:
        """Sharded gradients *= scale (local shards: no communication)."""
        for p in self.manager.model.parameters():
            if p.grad is not None and scale != 1.0:
                local_shard(p.grad).mul_(scale)

    # ---- checkpoints and export ---------------------------------------------------------------
    def save_checkpoint(self, root, step: int):
        return self.manager.save_checkpoint(root, step)

    def load_checkpoint(self, root) -> int:
        step, _ = self.manager.load_checkpoint(root)
        return step

    def export_hf(self, out_dir, overwrite: bool = False):
        """config.json is the model's (value_model_config's: num_labels 1, no bias, no dropout);
        tokenizer files come from model.path."""
        return self.manager.export_hf(out_dir, overwrite)

    # ---- colocated GPUs -----------------------------------------------------------------------
    def offload_for_rollout(self) -> dict:
        """Adam's state, the parameter shards and any gradients to the host (between steps the
        gradients are None: nothing to move)."""
        pm = self.manager
        if "optimizer state" not in pm.offloaded:
            pm.offload_optimizer()
        if "params" not in pm.offloaded:
            pm.offload_param_and_grad(offload_grad=True)
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return {"offloaded": sorted(pm.offloaded), "device_bytes": allocated}

    def onload_for_training(self) -> dict:
        pm = self.manager
        if "params" in pm.offloaded:
            pm.load_param_and_grad(pm.device, load_grad=True)
        if "optimizer state" in pm.offloaded:
            pm.load_optimizer(pm.device)
        return {"offloaded": sorted(pm.offloaded)}
