"""MegatronCritic: the value model on one trainer rank, over megatron-core (tensor, pipeline, data parallel).

It implements rlmega.critic_api.Critic: the policy's GPTModel with a hidden -> 1 output layer
(rlmega/megatron/value_head.py), packed micro-batches and the pipeline schedule exactly as MegatronActor
runs them (rlmega/megatron/batching.py, policy.py), and rlmega.algorithms.value_loss's loss and metrics.

    critic = MegatronCritic(**critic_kwargs(cfg))       # rlmega.critic_api
    critic.setup()
    values = critic.compute_values(batch)               # per sample (response_len,) float32
    metrics = critic.train_step(replace(batch, returns=returns, old_values=values))
"""
from __future__ import annotations

import functools
import math

import torch
from megatron.core import parallel_state as ps

from rlmega.algorithms import value_loss
from rlmega.config.schema import CriticConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.critic_api import Critic
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.megatron import batching, checkpoint, policy
from rlmega.megatron.model_manager import PHASE_KINDS, MegatronModelManager
from rlmega.megatron.runtime import init_megatron, teardown_megatron


def _values(output: torch.Tensor) -> torch.Tensor:
    """The value head's output (T, 1) -> (T,) float32 (Float16Module hands it back in fp32 already)."""
    return output[:, 0].float()


class MegatronCritic(Critic):
    """The Critic interface (rlmega/critic_api.py) over megatron-core."""

    def __init__(self, model: ModelConfig, parallel: ParallelismConfig, optimizer: OptimizerConfig,
                 critic: CriticConfig, max_tokens_per_micro_batch: int = 2048, loss_agg_mode: str = "token-mean",
                 lr_decay_steps: int = 1000, hf_config: dict | None = None, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if int(getattr(parallel, "expert_model_parallel_size", 1) or 1) > 1:
            raise ValueError("critic.parallelism.expert_model_parallel_size > 1: an MoE critic runs its experts "
                             "without expert parallelism; set it to 1")
        self.model_cfg, self.parallel, self.optim_cfg, self.cfg = model, parallel, optimizer, critic
        self.max_tokens, self.loss_agg_mode = max_tokens_per_micro_batch, loss_agg_mode
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.manager: MegatronModelManager | None = None

    def setup(self) -> None:
        p = self.parallel
        init_megatron(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.virtual_pipeline_model_parallel_size, seed=self.model_cfg.seed)
        self.manager = MegatronModelManager(self.model_cfg, p, self.optim_cfg, lr_decay_steps=self.lr_decay_steps,
                                            hf_config=self.hf_config, value_head=True)
        self.manager.setup_model_and_optimizer(load_weights=bool(self.model_cfg.path))

    def teardown(self) -> None:
        teardown_megatron()

    def _plan(self, batch: RolloutBatch):
        return batching.plan(self.manager, batch, self.max_tokens, self.parallel.pipeline_model_parallel_size)

    # ---- forward and train --------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> list[torch.Tensor]:
        mbs, _ = self._plan(batch)

        def step(data_iterator, chunk):
            mb = next(data_iterator)
            output = policy.forward_chunk(chunk, mb)

            def collect(out):
                return out.sum() * 0.0, torch.ones((), dtype=torch.int), {"values": _values(out)}

            return output, collect

        outs = policy.run_schedule(self.manager.model, mbs, step, forward_only=True)
        return batching.gather_responses(mbs, outs if ps.is_pipeline_last_stage(ignore_virtual=True)
                                         else None, "values", batch)

    def train_step(self, batch: RolloutBatch) -> dict:
        if batch.returns is None:
            raise ValueError("critic train_step needs batch.returns (GAE's, rlmega.algorithms.gae)")
        mbs, _ = self._plan(batch)
        loss_fn = functools.partial(value_loss.critic_loss, cliprange=self.cfg.cliprange_value,
                                    loss_agg_mode=self.loss_agg_mode)

        def step(data_iterator, chunk):
            mb = next(data_iterator)
            output = policy.forward_chunk(chunk, mb)

            def loss(out):
                fields = policy.per_token_on(mb, out.device)
                numerator, count, stats = loss_fn(fields, _values(out))
                stats = {k: torch.as_tensor(v, dtype=torch.float64, device=out.device).detach()
                         for k, v in stats.items()}
                stats["numerator"], stats["count"] = numerator.detach().double(), count.detach().double()
                return numerator, count.detach().round().int(), stats

            return output, loss

        outs = policy.run_schedule(self.manager.model, mbs, step, forward_only=False)
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        keys = value_loss.SUM_KEYS
        sums = torch.stack([sum(o[k] for o in outs) for k in keys]) if last and outs else None
        sums = policy.sum_over_data_parallel(policy.share_from_last_stage(sums, len(keys)))
        s = dict(zip(keys, sums.tolist()))
        loss = s["numerator"] / max(s["count"], 1.0)
        if math.isfinite(loss):  # global: every rank takes the same branch
            ok, grad_norm, lr = self.manager.optimizer_step(skip_nonfinite=True)
        else:
            self.manager.optimizer.zero_grad()
            ok, grad_norm, lr = False, float("nan"), float(self.manager.optimizer.param_groups[0]["lr"])
        return value_loss.critic_metrics(s, grad_norm, lr, ok)

    # ---- state ---------------------------------------------------------------------------------
    def save_checkpoint(self, root, step: int):
        return self.manager.save_checkpoint(root, step)

    def load_checkpoint(self, root) -> int:
        return self.manager.load_checkpoint(checkpoint.latest(root) or root)[0]

    def export_hf(self, out_dir, overwrite: bool = False):
        return self.manager.export_hf(out_dir, overwrite)

    _KINDS = PHASE_KINDS

    def offload_for_rollout(self) -> dict:
        """critic.offload_while_generating (resolved by the caller): everything to the host."""
        if self.cfg.offload_while_generating:
            for kind, offload_fn, _ in self._KINDS:
                if kind not in self.manager.offloaded:
                    getattr(self.manager, offload_fn)()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return {"offloaded": sorted(self.manager.offloaded)}

    def onload_for_training(self) -> dict:
        for kind, _, onload_fn in self._KINDS:
            if kind in self.manager.offloaded:
                getattr(self.manager, onload_fn)()
        return {"offloaded": sorted(self.manager.offloaded)}
