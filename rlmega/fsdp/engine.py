"""FSDPEngine: rlmega.learner.engine_api.TrainEngine over torch FSDP2 and any Hugging Face causal LM (or its
value model).

It is an FSDPModelManager (the sharded model, AdamW, LR schedule, offload, DCP checkpoints) that also
runs the passes. How a step maps onto FSDP2:
- A batch is planned once (rlmega/data/shards.py, balanced by tokens) and each rank runs its share. Each
  forward all-gathers the parameters, so every rank runs the SAME number of micro-batches (``layout``'s
  equal_counts): a rank with fewer gets placeholders (build_micro_batch(batch, []): zero loss mask).
- Gradients are reduced only on the last micro-batch (before_micro_batch).
- Global normalisation (Megatron's calculate_per_token_loss): each micro-batch back-propagates its loss
  numerator; ``normalize_grads(count)`` then multiplies the sharded gradients by world_size / global count
  (FSDP2's reduce-scatter averages over ranks, i.e. divides by world_size), so the gradient is exactly
  d(sum numerators)/d(theta) / count, the single-process one, before clipping and the optimizer step. The
  count is only known after the forwards (rollout correction may drop tokens by the forward's own
  log-probs), hence after, not before.
- The HF model trains as Megatron's mapping does: dropout off (train mode kept for activation
  checkpointing) and the pad token's embedding row trained (HF's padding_idx would freeze it).
- After a no-grad pass the root's parameters are resharded (FSDP2 keeps them whole otherwise).

``value_head``: the policy's architecture as transformers' ``AutoModelForTokenClassification`` with one
label, no bias and no dropout (rlmega/fsdp/value_model.py): the critic's.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rlmega.learner import lora
from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.micro_batches import scatter_responses
from rlmega.data.shards import Layout, Shard
from rlmega.process.distributed import init_distributed
from rlmega.learner.engine_api import Head, LossFn, TrainEngine
from rlmega.rundir.checkpoint_files import resolve
from rlmega.fsdp.checkpoint import read_meta
from rlmega.fsdp import ulysses
from rlmega.fsdp.forward import check_chunkable, forward_logits, micro_batch_logprobs
from rlmega.fsdp.model_manager import FSDPModelManager, local_shard
from rlmega.fsdp.value_model import value_model


def _reshard(model) -> None:
    """Back to sharded parameters. FSDP2 keeps the ROOT module's parameters unsharded after a forward
    (its backward would gather them again at once); after a no-grad forward no backward comes, so
    they would stay whole: full-size memory, and parameters that no longer pair with the other
    model's shards (the Polyak update) or with the optimizer's."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _no_dropout(model: torch.nn.Module) -> None:
    """Dropout off, as Megatron's mapping sets it (hidden and attention dropout 0): a log-prob (or value)
    must be a function of the weights (the PPO ratio's old and new, parity with the engine). The model
    stays in train mode, which HF's activation checkpointing needs."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0  # HF attention modules pass it to sdpa in train mode


class FSDPEngine(FSDPModelManager, TrainEngine):
    # "params" moves the gradients too (None between steps: nothing held); there is no fp32 copy apart
    # from the parameters (the sharded parameters are the optimizer's float32 master weights)
    PHASE_KINDS = ("optimizer state", "params")

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelismConfig,
        optimizer: OptimizerConfig,
        actor: ActorConfig | None = None,
        *,
        value_head: bool = False,
        with_optimizer: bool = True,
        max_tokens_per_micro_batch: int | None = None,
        lr_decay_steps: int = 1000,
        hf_config: dict | None = None,
    ):
        """``actor``: the policy's knobs the model needs (activation checkpointing, the token budget); None
        for a value model (``value_head``: the critic's, without recomputation). The process group must
        be up (``init_process``) with parallelism.world_size ranks."""
        actor = actor or ActorConfig()
        world, rank = dist.get_world_size(), dist.get_rank()
        if parallel.world_size != world:
            raise ValueError(
                f"parallelism.world_size={parallel.world_size} but {world} ranks were started; fix: "
                "set parallelism.world_size (critic.parallelism for the critic) to the trainer's ranks"
            )
        super().__init__(
            model, optimizer, actor, world, rank, lr_decay_steps=lr_decay_steps, hf_config=hf_config
        )
        self.value_head, self.with_optimizer = value_head, with_optimizer
        self.max_tokens = max_tokens_per_micro_batch or actor.max_tokens_per_micro_batch
        self.chunk_tokens = 0 if value_head else actor.logprob_chunk_tokens
        # Ulysses (rlmega/fsdp/ulysses.py): groups of U consecutive ranks share each micro-batch
        self.ulysses = 1 if value_head else actor.ulysses_size
        if world % self.ulysses:
            raise ValueError(f"actor.ulysses_size={self.ulysses} does not divide the {world} ranks")
        self.ulysses_group = None
        if self.ulysses > 1:
            # every rank makes every group, in the same order
            for start in range(0, world, self.ulysses):
                group = dist.new_group(list(range(start, start + self.ulysses)))
                if start <= rank < start + self.ulysses:
                    self.ulysses_group = group
        if value_head:
            self.AUTO_CLASS = "AutoModelForTokenClassification"  # what an export is rebuilt with

    # ---- process and model --------------------------------------------------------------------
    @staticmethod
    def init_process(parallel: ParallelismConfig, seed: int) -> None:
        init_distributed()

    @staticmethod
    def teardown_process() -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def model_provider_func(self) -> torch.nn.Module:
        if self.value_head:
            return value_model(self.model_cfg, self.hf_config)
        return super().model_provider_func()

    def build(self) -> None:
        self.setup_model_and_optimizer(with_optimizer=self.with_optimizer)
        # HF builds the input embedding with padding_idx=config.pad_token_id, which zeroes that row's
        # gradient. A sampled sequence may hold the pad token (Qwen's pad is <|endoftext|>); Megatron
        # (and the gradient of the loss) trains its row like any other, so this backend does too.
        # padding_idx only acts in the backward: the forward is unchanged.
        emb = self.model.get_input_embeddings()
        if getattr(emb, "padding_idx", None) is not None:
            emb.padding_idx = None
        _no_dropout(self.model)
        # a VLM's language model (the config itself for an LM)
        config = self.model.config.get_text_config()
        self.vocab_size = int(config.vocab_size)
        if self.chunk_tokens:
            check_chunkable(config)
        if self.ulysses > 1:
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            ulysses.check_heads(config.num_attention_heads, kv_heads, self.ulysses)

    # ---- data ---------------------------------------------------------------------------------
    def layout(self) -> Layout:
        """Every rank runs as many micro-batches (each forward all-gathers the parameters). Under Ulysses a
        group of U ranks takes one share, its rows padded to a multiple of U and up to U x the per-rank budget."""
        return Layout(
            dp_size=self.world_size // self.ulysses,
            max_tokens=self.max_tokens * self.ulysses,
            equal_counts=True,
            row_multiple=self.ulysses,
        )

    def dp_rank(self) -> int:
        return self.rank // self.ulysses

    def micro_batches(self, shard: Shard) -> list[dict]:
        """TrainEngine's, each cut to this rank's part of its row under Ulysses."""
        mbs = super().micro_batches(shard)
        if self.ulysses == 1:
            return mbs
        return [
            ulysses.localise(mb, self.rank % self.ulysses, self.ulysses, self.ulysses_group)
            for mb in mbs
        ]

    # ---- passes -------------------------------------------------------------------------------
    def _outputs(self, mb: dict, head: Head) -> tuple:
        """The Head's per-token outputs of one micro-batch, in its order: (log-probs, entropy or None) or
        (values,)."""
        shard = mb.get("ulysses")
        # this rank's part of the row; the results come back whole (ulysses.py)
        if shard is not None:
            mb = {**mb, **shard.head_fields}
        with ulysses.active(shard):
            if head.kind == "values":
                out = (forward_logits(self.model, mb)[:, 0].float(),)  # (T, 1) -> (T,)
            else:
                out = micro_batch_logprobs(
                    self.model,
                    mb,
                    head.temperature,
                    head.entropy,
                    head.entropy_grad,
                    chunk=self.chunk_tokens,
                )
        return out if shard is None else tuple(None if t is None else shard.to_full(t) for t in out)

    @torch.no_grad()
    def forward(self, mbs: list[dict], head: Head, routes=None) -> list[dict]:
        keys = ("values",) if head.kind == "values" else ("logprobs", "entropy")
        outs = [dict(zip(keys, self._outputs(mb, head))) for mb in mbs]
        _reshard(self.model)
        return outs

    def forward_backward(
        self, mbs: list[dict], head: Head, loss_fn: LossFn, routes=None
    ) -> list[dict]:
        device, outs = self.device, []
        for k, mb in enumerate(mbs):
            self.before_micro_batch(self.model, is_last_micro_batch=k == len(mbs) - 1)
            fields = {
                key: v.to(device) if torch.is_tensor(v) and v.dim() == 1 else v
                for key, v in mb.items()
            }
            outputs = self._outputs(fields, head)
            numerator, count, stats = loss_fn(fields, *outputs)
            # e.g. nothing of the loss depends on the weights: still run
            if not numerator.requires_grad:
                # the backward, whose reduce-scatter every rank joins
                numerator = numerator + outputs[0].sum() * 0.0
            # activation checkpointing recomputes attention in here
            with ulysses.active(mb.get("ulysses")):
                numerator.backward()
            out = {key: torch.as_tensor(v, device=device).double() for key, v in stats.items()}
            out["numerator"], out["count"] = numerator.detach().double(), count.detach().double()
            if head.keep_logprobs:
                out["logprobs"] = outputs[0].detach()
            outs.append(out)
        return outs

    def gather_responses(
        self, mbs: list[dict], outs: list[dict] | None, key: str, shard: Shard
    ) -> list[torch.Tensor]:
        mine = {}
        for mb, out in zip(mbs, outs or []):
            mine.update(
                {i: v.detach().float().cpu() for i, v in scatter_responses(out[key], mb).items()}
            )
        return [mine[i] for i in shard.own]

    def gather_data_parallel(self, shard: Shard, results: list) -> list:
        parts = [None] * self.world_size
        dist.all_gather_object(parts, dict(zip(shard.samples, results)))
        merged = {i: v for part in parts for i, v in part.items()}
        return [merged[i] for i in range(len(merged))]

    def global_sums(self, outs: list[dict] | None, keys: tuple[str, ...]) -> dict[str, float]:
        sums = (
            torch.stack([sum(o[k] for o in outs) for k in keys])
            if outs
            else torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        )
        if self.rank % self.ulysses:
            # a Ulysses group's ranks hold the same sums: its first one counts
            sums = torch.zeros_like(sums)
        dist.all_reduce(sums)  # on the device: the GPU under nccl, the host under gloo
        return dict(zip(keys, sums.cpu().tolist()))

    # ---- optimizer ----------------------------------------------------------------------------
    @torch.no_grad()
    def normalize_grads(self, count: float) -> None:
        """Sharded gradients *= world_size / count (local shards: no communication); / U under Ulysses, whose
        U ranks of a group each back-propagate the group's whole loss (ulysses.py)."""
        scale = self.world_size / (max(count, 1.0) * self.ulysses)
        if scale == 1.0:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                local_shard(p.grad).mul_(scale)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ---- memory -------------------------------------------------------------------------------
    def offload(self, kind: str) -> None:
        if kind == "params":
            self.offload_param_and_grad(offload_grad=True)
        else:
            self.offload_optimizer()

    def onload(self, kind: str) -> None:
        if kind == "params":
            self.load_param_and_grad(self.device, load_grad=True)
        else:
            self.load_optimizer(self.device)

    # ---- state --------------------------------------------------------------------------------
    def saved_models(self, root) -> set[str]:
        return set(read_meta(resolve(root))["extra_models"])

    # ---- weights out --------------------------------------------------------------------------
    def weights_out(self, pieces: bool, weights: str = "merged") -> tuple[bool, Iterator]:
        """Every rank takes part in each parameter's all-gather (one at a time: only the bucket being
        filled is held in full); rank 0 sends. A frozen vision tower stays out (the engines hold model.path's)."""
        return self.rank == 0, self.iter_full_tensors(weights, skip=self.frozen_tower)

    def barrier(self) -> None:
        dist.barrier()

    def adapters_disabled(self):
        if not self.lora_rank:
            return super().adapters_disabled()
        return lora.adapters_disabled(self.model)

    def param_pairs(self, other: "FSDPEngine") -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine, theirs = list(self.model.named_parameters()), list(other.model.named_parameters())
        if [n for n, _ in mine] != [n for n, _ in theirs]:
            raise RuntimeError(
                "reference and policy parameters differ: they must be built from one config"
            )
        return [(local_shard(a), local_shard(b)) for (_, a), (_, b) in zip(mine, theirs)]
