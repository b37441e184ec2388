"""ValueCritic: the value model of PPO (algorithm.advantage_estimator=gae) on the trainer ranks, written once
over a backend engine (rlmega/learner/engine_api.py) with a value head.

It implements rlmega.learner.critic_api.Critic: the policy's architecture with a hidden -> 1 head (the engine's
``value_head``), packed micro-batches as the actor's, rlmega.algorithms.value_loss's clipped loss and
metrics, the non-finite rule (a skip on every rank), checkpoints and the colocated offload. Each
backend's critic is this class with its engine class (rlmega/megatron/critic.py: MegatronCritic,
rlmega/fsdp/critic.py: FSDPCritic).

    critic = MegatronCritic(**critic_kwargs(cfg))       # rlmega.config.resolved
    critic.setup()
    values = critic.compute_values(batch)               # per sample (response_len,) float32
    metrics = critic.train_step(replace(batch, returns=returns, old_values=values))
"""

from __future__ import annotations

import functools
import math

import torch

from rlmega.algorithms import losses, value_loss
from rlmega.config.schema import CriticConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.learner.critic_api import Critic
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.shards import Shard
from rlmega.learner.engine_api import Head, StepResult, TrainEngine

VALUES = Head(kind="values")


class ValueCritic(Critic):
    engine_class: type[TrainEngine]
    """The backend's engine (each backend's subclass sets it)."""

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelismConfig,
        optimizer: OptimizerConfig,
        critic: CriticConfig,
        max_tokens_per_micro_batch: int = 2048,
        loss_agg_mode: str = "token-mean",
        lr_decay_steps: int = 1000,
        hf_config: dict | None = None,
        num_threads: int | None = None,
    ):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if loss_agg_mode not in losses.AGGREGATIONS:
            raise ValueError(
                f"loss_agg_mode={loss_agg_mode!r}; valid: {', '.join(losses.AGGREGATIONS)}"
            )
        if parallel.expert_model_parallel_size > 1:
            raise ValueError(
                "critic.parallelism.expert_model_parallel_size > 1: an MoE critic runs its experts "
                "without expert parallelism; set it to 1"
            )
        self.model_cfg, self.parallel, self.optim_cfg, self.cfg = model, parallel, optimizer, critic
        self.max_tokens, self.loss_agg_mode = max_tokens_per_micro_batch, loss_agg_mode
        self.lr_decay_steps, self.hf_config = lr_decay_steps, hf_config
        self.manager: TrainEngine | None = None  # (RLinf's name for the model's manager)

    def setup(self) -> None:
        self.engine_class.init_process(self.parallel, self.model_cfg.seed)
        self.manager = self.engine_class(
            self.model_cfg,
            self.parallel,
            self.optim_cfg,
            value_head=True,
            max_tokens_per_micro_batch=self.max_tokens,
            lr_decay_steps=self.lr_decay_steps,
            hf_config=self.hf_config,
        )
        self.manager.build()

    def teardown(self) -> None:
        self.engine_class.teardown_process()

    def data_layout(self):
        """(how the value model wants a batch split, this rank's data-parallel rank)."""
        return self.manager.layout(), self.manager.dp_rank()

    # ---- values and training ------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch | Shard) -> list[torch.Tensor]:
        engine = self.manager
        shard = engine.shard(batch)
        mbs = engine.micro_batches(shard)
        mine = engine.gather_responses(mbs, engine.forward(mbs, VALUES), "values", shard)
        return mine if isinstance(batch, Shard) else engine.gather_data_parallel(shard, mine)

    def train_step(self, batch: RolloutBatch | Shard) -> dict:
        """Each micro-batch back-propagates its loss numerator; numerators, counts and statistics are
        summed over micro-batches and ranks, and the gradient normalised over the global count: the
        gradient of the global batch's loss, whatever the layout or token budget. A non-finite loss or
        gradient norm skips the step on every rank (the sums and the norm are global)."""
        engine = self.manager
        shard = engine.shard(batch)
        if shard.batch.returns is None:
            raise ValueError(
                "critic train_step needs batch.returns (the GAE returns, rlmega.algorithms.gae)"
            )
        mbs = engine.micro_batches(shard)
        loss_fn = functools.partial(
            value_loss.critic_loss,
            cliprange=self.cfg.cliprange_value,
            loss_agg_mode=self.loss_agg_mode,
        )
        s = engine.global_sums(engine.forward_backward(mbs, VALUES, loss_fn), value_loss.SUM_KEYS)
        if math.isfinite(s["numerator"] / max(s["count"], 1.0)):
            engine.normalize_grads(s["count"])
            step = engine.optimizer_step(skip_nonfinite=True)
        else:
            engine.zero_grad()
            step = StepResult(False, float("nan"), engine.current_lr())
        return value_loss.critic_metrics(s, step.grad_norm, step.lr, step.taken)

    # ---- state ---------------------------------------------------------------------------------
    def save_checkpoint(self, root, step: int):
        return self.manager.save_checkpoint(root, step)

    def load_checkpoint(self, root) -> int:
        return self.manager.load_checkpoint(root)[0]

    def export_hf(self, out_dir, overwrite: bool = False):
        """config.json is the value model's (rlmega.config.value_model: num_labels 1, no bias, no dropout);
        tokenizer files come from model.path."""
        return self.manager.export_hf(out_dir, overwrite)

    # ---- colocated GPUs -------------------------------------------------------------------------
    def offload_for_rollout(self) -> dict:
        """critic.offload_while_generating (resolved by the caller): parameters, gradients and optimizer
        state to the host, the freed memory back to the device."""
        engine = self.manager
        if self.cfg.offload_while_generating:
            for kind in engine.PHASE_KINDS:
                if kind not in engine.offloaded:
                    engine.offload(kind)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return {"offloaded": sorted(engine.offloaded), "device_bytes": allocated}

    def onload_for_training(self) -> dict:
        engine = self.manager
        for kind in engine.PHASE_KINDS:
            if kind in engine.offloaded:
                engine.onload(kind)
        return {"offloaded": sorted(engine.offloaded)}
