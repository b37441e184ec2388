"""MegatronEngine: rlmega.learner.engine_api.TrainEngine over megatron-core (tensor, pipeline, data, expert parallel).

It is a MegatronModelManager (the model, optimizer, schedule, offload and checkpoints of one model on
one rank) that also runs the passes: packed micro-batches of a rank's shard (``micro_batches``, planned by
rlmega/data/packing.py), forward and forward+backward through megatron-core's own pipeline
schedule with the loss as its ``loss_func`` (rlmega/megatron/pipeline_passes.py), and the per-sample results
gathered from the last pipeline stage over the data-parallel ranks.

    MegatronEngine.init_process(cfg.parallelism, seed)          # megatron's parallel state
    engine = MegatronEngine(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor)
    engine.build()
    outs = engine.forward(engine.micro_batches(shard), Head())  # see rlmega/learner/engine_api.py

MoE routing replay is Megatron's alone: ``routes`` (a routing_replay.RoutePass) rides along a pass;
MegatronActor keeps its bookkeeping (rlmega/megatron/actor.py).
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.micro_batches import scatter_responses
from rlmega.data.shards import Layout, Shard
from rlmega.learner.engine_api import Head, LossFn, TrainEngine
from rlmega.megatron import checkpoint, context_parallel, lora_adapters, pipeline_passes
from rlmega.megatron.hf_io import iter_hf_tensors
from rlmega.megatron.model_manager import PHASE_KINDS as MOVES, MegatronModelManager
from rlmega.megatron.runtime import (
    barrier,
    context_parallel_rank,
    data_parallel_rank_and_size,
    init_megatron,
    replica_rank,
    teardown_megatron,
    tensor_parallel_rank,
)


class MegatronEngine(MegatronModelManager, TrainEngine):
    PHASE_KINDS = tuple(kind for kind, _, _ in MOVES)  # grads, optimizer state, main params, params
    _MOVES = {kind: (off, on) for kind, off, on in MOVES}

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
        """``actor``: the policy's knobs the model needs (its MoE router-loss coefficients, its token budget);
        None for a value model (``value_head``: a hidden -> 1 head, the critic's). Every MoE policy's
        routers get megatron's RouterReplay hook: it routes live unless a pass replays, and it is what
        measures router_mismatch (rlmega/megatron/routing_replay.py)."""
        actor = actor or ActorConfig()
        super().__init__(
            model,
            parallel,
            optimizer,
            lr_decay_steps=lr_decay_steps,
            hf_config=hf_config,
            moe_aux_loss_coeff=actor.moe_aux_loss_coeff,
            moe_z_loss_coeff=actor.moe_z_loss_coeff,
            moe_router_bias_update_rate=0.0 if value_head else actor.moe_router_bias_update_rate,
            routing_replay=not value_head,
            value_head=value_head,
            lora=None if value_head else actor.lora,
        )
        self.with_optimizer = with_optimizer
        self.max_tokens = max_tokens_per_micro_batch or actor.max_tokens_per_micro_batch
        self.vocab_size = self.shape.vocab_size
        self.chunk_tokens = 0 if value_head else actor.logprob_chunk_tokens
        self.sequence_parallel = self.transformer_config.sequence_parallel
        self.cp = parallel.context_parallel_size

    # ---- process and model --------------------------------------------------------------------
    @staticmethod
    def init_process(parallel: ParallelismConfig, seed: int) -> None:
        init_megatron(
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size,
            seed=seed,
            ep=parallel.expert_model_parallel_size,
            cp=parallel.context_parallel_size,
        )

    @staticmethod
    def teardown_process() -> None:
        teardown_megatron()

    def build(self) -> None:
        self.setup_model_and_optimizer(
            load_weights=bool(self.model_cfg.path), with_optimizer=self.with_optimizer
        )

    # ---- data ---------------------------------------------------------------------------------
    def layout(self) -> Layout:
        """Megatron's interleaved schedule needs a multiple of PP micro-batches per rank. Under expert
        parallelism every MoE layer's token dispatch is a collective over the expert-parallel group (part of
        the data-parallel ranks): each rank runs as many micro-batches (placeholders fill in), and with the
        allgather dispatcher (CPU, no Transformer Engine) of one shape (it gathers equal blocks). Under
        context parallelism a micro-batch holds CP x the per-rank token budget, and each rank's share of a
        row (not the row) is padded to a multiple of TP under sequence parallelism."""
        ep = self.transformer_config.expert_model_parallel_size > 1
        allgather = (
            not self.use_te and self.transformer_config.moe_token_dispatcher_type == "allgather"
        )
        return Layout(
            dp_size=data_parallel_rank_and_size()[1],
            max_tokens=self.max_tokens * self.cp,
            multiple_of=self.parallel.pipeline_model_parallel_size if self.vpp > 1 else 1,
            equal_counts=ep,
            equal_shapes=ep and allgather,
            row_multiple=1 if self.cp > 1 else self._sp_multiple,
        )

    @property
    def _sp_multiple(self) -> int:
        return self.parallel.tensor_model_parallel_size if self.sequence_parallel else 1

    def micro_batches(self, shard: Shard) -> list[dict]:
        """TrainEngine's, each cut to this rank's share under context parallelism (context_parallel.py).
        With equal shapes (layout) the k-th share is as long on every DP rank: the allgather dispatcher's
        expert-parallel group may span DP ranks, whose rows split into shares of different lengths."""
        mbs = super().micro_batches(shard)
        if self.cp == 1:
            return mbs
        multiple = self._sp_multiple
        lengths = [
            context_parallel.share_length(context_parallel.mb_segments(mb), self.cp, multiple)
            for mb in mbs
        ]
        if self.layout().equal_shapes:
            lengths = context_parallel.longest_over_data_parallel(lengths)
        return [
            context_parallel.localise(mb, self.cp, context_parallel_rank(), multiple, n)
            for mb, n in zip(mbs, lengths)
        ]

    def dp_rank(self) -> int:
        return data_parallel_rank_and_size()[0]

    # ---- passes -------------------------------------------------------------------------------
    def forward(self, mbs: list[dict], head: Head, routes=None) -> list[dict] | None:
        if head.kind == "values":
            return pipeline_passes.forward_values(self.model, mbs)
        return pipeline_passes.forward_logprobs(
            self.model,
            mbs,
            self.vocab_size,
            head.temperature,
            head.entropy,
            routes=routes,
            chunk_tokens=self.chunk_tokens,
        )

    def forward_backward(
        self, mbs: list[dict], head: Head, loss_fn: LossFn, routes=None
    ) -> list[dict] | None:
        if head.kind == "values":
            return pipeline_passes.train_values(self.model, mbs, loss_fn)
        return pipeline_passes.train_micro_batches(
            self.model,
            mbs,
            self.vocab_size,
            head.temperature,
            loss_fn,
            with_entropy=head.entropy,
            entropy_grad=head.entropy_grad,
            keep_logprobs=head.keep_logprobs,
            routes=routes,
            chunk_tokens=self.chunk_tokens,
        )

    def gather_responses(
        self, mbs: list[dict], outs: list[dict] | None, key: str, shard: Shard
    ) -> list[torch.Tensor]:
        """The last pipeline stage's outputs (``outs``, None elsewhere), shared with the stage's peers."""
        order = [i for mb in mbs for i in mb["indices"]]
        all_lens = shard.batch.response_lens()  # once: it walks the whole batch
        lens = [all_lens[i] for i in order]
        flat = None
        if outs is not None:
            pieces = {}
            for mb, out in zip(mbs, outs):
                pieces.update(scatter_responses(out[key], mb))
            flat = torch.cat([pieces[i] for i in order]) if order else torch.zeros(0)
        mine = dict(
            zip(order, pipeline_passes.share_from_last_stage(flat, sum(lens)).float().split(lens))
        )
        return [mine[i] for i in shard.own]

    def gather_data_parallel(self, shard: Shard, results: list) -> list:
        merged = {}
        for part in pipeline_passes.all_gather_data_parallel(dict(zip(shard.samples, results))):
            merged.update(part)
        return [merged[i] for i in range(len(merged))]

    def global_sums(self, outs: list[dict] | None, keys: tuple[str, ...]) -> dict[str, float]:
        # outs is None off the last pipeline stage (it sends nothing); [] would sum to zeros
        sums = (
            None
            if outs is None
            else torch.stack(
                [torch.as_tensor(sum(o[k] for o in outs), dtype=torch.float64) for k in keys]
            )
        )
        sums = pipeline_passes.sum_over_data_parallel(
            pipeline_passes.share_from_last_stage(sums, len(keys))
        )
        return dict(zip(keys, sums.tolist()))

    # ---- optimizer ----------------------------------------------------------------------------
    def normalize_grads(self, count: float) -> None:
        """Nothing to do: Megatron's schedule has already divided the gradients by the global count (its
        ``calculate_per_token_loss``: the loss functions hand it their counts)."""

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def advance_lr_schedule(self, steps: int) -> None:
        self.scheduler.step(increment=steps)

    # ---- memory -------------------------------------------------------------------------------
    def offload(self, kind: str) -> None:
        getattr(self, self._MOVES[kind][0])()

    def onload(self, kind: str) -> None:
        getattr(self, self._MOVES[kind][1])()

    # ---- state --------------------------------------------------------------------------------
    def save_checkpoint(
        self, root, step: int, extra: dict | None = None, extra_models: dict | None = None
    ):
        models = {k: v.model for k, v in (extra_models or {}).items()} or None
        return MegatronModelManager.save_checkpoint(self, root, step, extra, models)

    def load_checkpoint(
        self, root, model_only: bool = False, extra_models: dict | None = None
    ) -> tuple[int, dict]:
        models = {k: v.model for k, v in (extra_models or {}).items()} or None
        return MegatronModelManager.load_checkpoint(
            self, checkpoint.latest(root) or root, model_only, models
        )

    def saved_models(self, root) -> set[str]:
        return set(checkpoint.saved_models(checkpoint.latest(root) or root))

    # ---- weights out --------------------------------------------------------------------------
    def weights_out(self, pieces: bool, weights: str = "merged") -> tuple[bool, Iterator]:
        """In replica 0 (DP x CP rank 0), every TP rank of each pipeline stage sends its own blocks of the HF
        tensors with ``pieces`` (replicated tensors from TP rank 0); without, TP rank 0 sends whole
        tensors, gathered one parameter at a time. The other replicas hold the same weights and skip
        the gathers, except under expert parallelism > 1: an EP group spans DP ranks, so replica 0's
        expert gathers need every rank (with DP > EP the EP groups other than the sender's gather for
        nothing: a known cost, docs/moe.md)."""
        replica = replica_rank()  # DP x CP: the CP ranks of replica 0 hold the same weights too
        sender = replica == 0 and (tensor_parallel_rank() == 0 or pieces)
        iterate = replica == 0 or self.transformer_config.expert_model_parallel_size > 1
        # "base": the frozen weights as they are
        merge = self.adapters if weights == "merged" else None
        tensors = (
            iter_hf_tensors(self.model, self.shape, to_first=True, pieces=pieces, merge=merge)
            if iterate
            else iter(())
        )
        return sender, tensors

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        if not self.adapters:
            return super().adapter_tensors()
        return lora_adapters.adapter_tensors(self.adapters)

    def adapters_disabled(self):
        if not self.adapters:
            return super().adapters_disabled()
        return lora_adapters.disabled(self.adapters)

    def barrier(self) -> None:
        barrier()

    def param_pairs(self, other: "MegatronEngine") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The parameters, and the routers' expert bias: a buffer the policy moves under
        actor.moe_router_bias_update_rate, so the reference's Polyak update must follow it too."""

        def state(engine):
            return [
                (n, p)
                for chunk in engine.unwrapped()
                for n, p in [
                    *chunk.named_parameters(),
                    *(
                        (n, b)
                        for n, b in chunk.named_buffers()
                        if n.endswith("mlp.router.expert_bias")
                    ),
                ]
            ]

        mine, theirs = state(self), state(other)
        if [n for n, _ in mine] != [n for n, _ in theirs]:
            raise RuntimeError(
                "reference and policy parameters differ: they must be built from one config"
            )
        return [(a, b) for (_, a), (_, b) in zip(mine, theirs)]
