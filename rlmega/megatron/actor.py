"""MegatronActor: the learner on one trainer rank over megatron-core: PolicyActor with MegatronEngine.

The RL logic is rlmega/learner/policy_actor.py's, the passes MegatronEngine's (tensor, pipeline, data and expert
parallel; rlmega/megatron/engine.py). What is this backend's alone, and lives here: MoE routing replay.

    actor = MegatronActor(cfg.model, cfg.parallelism, cfg.optimizer, cfg.actor, cfg.algorithm,
                          temperature=cfg.rollout.temperature)
    actor.setup()                                   # Megatron groups, policy, reference
    old = actor.compute_logprobs(batch)             # list of (response_len,) per sample

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
from typing import Sequence

import torch

from rlmega.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
)
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.megatron import pipeline_passes, routing_replay
from rlmega.megatron.engine import MegatronEngine
from rlmega.learner.policy_actor import PolicyActor


class MegatronActor(PolicyActor):
    """The Actor interface (rlmega/learner/actor_api.py, its rules included) over megatron-core."""

    engine_class = MegatronEngine

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
        # config validation refuses it too; this covers actors built in code
        if actor.activation_checkpointing:
            raise ValueError(
                "actor.activation_checkpointing=true: the megatron backend does not recompute "
                "activations; set it to false, or use actor.backend=fsdp"
            )
        super().__init__(
            model,
            parallel,
            optimizer,
            actor,
            algorithm,
            temperature,
            lr_decay_steps,
            hf_config,
            num_threads,
            teachers,
            offload_teachers,
        )
        # MoE routing replay (algorithm.routing_replay): none | trainer (R2) | rollout (R3)
        self.routing_replay = self.algo.routing_replay
        self._routes: dict[int, routing_replay.ModelRoutes] = {}  # id(engine) -> its routers
        # R2: sample_id -> (L_i, M, K) of the old forward (own share)
        self._trainer_routes: dict[int, torch.Tensor] = {}
        # of the last compute_logprobs, reported by the train_steps after it
        self._route_metrics: dict = {}

    def setup(self, with_reference: bool = True) -> None:
        super().setup(with_reference)
        if self.routing_replay != "none" and not self.policy.shape.is_moe:
            raise ValueError(
                f"algorithm.routing_replay={self.routing_replay} needs a mixture-of-experts model; "
                f"{self.policy.shape.architecture} is dense: set it to none"
            )
        # each model's own routers (the reference has its own RouterReplay instances)
        for engine in (self.policy, self.reference):
            if engine is not None and engine.shape.is_moe:
                self._routes[id(engine)] = routing_replay.ModelRoutes(engine.model)

    # ---- MoE routing replay: PolicyActor's hooks ------------------------------------------------
    def _replays(self, batch: RolloutBatch, what: str) -> bool:
        """R3: the forwards replay the engine's routes, which the batch must then carry."""
        if self.routing_replay != "rollout":
            return False
        if batch.routed_experts is None:
            raise ValueError(
                f"algorithm.routing_replay=rollout: {what} needs batch.routed_experts (the engine's "
                "routes; the rollout workers record them when routing replay is rollout)"
            )
        return True

    def _forward_routing(self, batch: RolloutBatch, what: str) -> tuple[bool, bool]:
        """R3 replays the engine's routes; R2's compute_logprobs records the routes it takes, for
        train_step to replay (by sample id)."""
        return self._replays(
            batch, what
        ), self.routing_replay == "trainer" and what == "compute_logprobs"

    def _route_pass(self, engine: MegatronEngine, mbs: list[dict], replay: bool, record: bool):
        """The routing bookkeeping of one pass of an MoE model (None for a dense one)."""
        model_routes = self._routes.get(id(engine))
        if model_routes is None or not model_routes.enabled:
            return None
        return routing_replay.RoutePass(
            model_routes, engine.model, mbs, replay=replay, record=record
        )

    def _pass_routes(
        self,
        engine: MegatronEngine,
        batch: RolloutBatch,
        mbs: list[dict],
        replay: bool,
        record: bool,
    ):
        """``replay``: the batch's routed_experts replace the routers' choice (-1 rows routed live);
        ``record``: self._trainer_routes gets the routes this pass used, per sample id."""
        if replay:
            self._routes[id(engine)].check(batch.routed_experts)
        return self._route_pass(engine, mbs, replay, record)

    def _route_results(self, routes, batch: RolloutBatch) -> dict:
        """Collectives: the pass's routes (when recorded, into self._trainer_routes) and its metrics."""
        # by sample id, this rank's share: _train_routing fetches what a train step needs
        if routes.record:
            ids, lengths = batch.sample_ids.tolist(), batch.lengths()
            recorded = routes.recorded_routes()
            missing = [ids[i] for mb in routes.mbs for i in mb["indices"] if i not in recorded]
            if missing:
                raise RuntimeError(
                    f"routing replay: no routes were recorded for samples {missing[:5]}"
                )
            shape = (routes.routes.num_moe_layers, routes.routes.topk)
            self._trainer_routes = routing_replay.merge_stage_routes(
                {ids[i]: r for i, r in recorded.items()},
                {ids[i]: lengths[i] for i in recorded},
                shape,
            )
        counts, load = routing_replay.reduce_counts(routes.counts, routes.load)
        return routing_replay.route_metrics(counts, load)

    def _forward_done(self, engine: MegatronEngine, routes, batch: RolloutBatch) -> None:
        """The policy's pass's routing metrics are the ones the train steps after it report (the
        reference's are computed, for their collectives, and dropped)."""
        if routes is not None:
            metrics = self._route_results(routes, batch)
            if engine is self.policy:
                self._route_metrics = metrics

    def _train_routing(self, batch: RolloutBatch, on_policy: bool) -> tuple[RolloutBatch, bool]:
        replay = self._replays(batch, "train_step")
        if self.routing_replay == "trainer" and not on_policy:
            # R2: replay what the old-log-prob forward (compute_logprobs) chose for these samples. On
            # policy, this forward is the old one: its own live routes are the ones to keep. The routes
            # were recorded on the ranks whose log-prob shares held the samples: fetch this share's.
            ids = batch.sample_ids.tolist()
            mine = routing_replay.exchange_routes(self._trainer_routes, ids)
            missing = [s for s in ids if s not in mine]
            if missing:
                raise ValueError(
                    f"algorithm.routing_replay=trainer: samples {missing[:5]} have no routes from "
                    "compute_logprobs; call it on this batch before train_step"
                )
            routed = [mine[s] for s in ids]
            batch, replay = dataclasses.replace(batch, routed_experts=routed), True
        return batch, replay

    def _train_routes(
        self, engine: MegatronEngine, batch: RolloutBatch, mbs: list[dict], replay: bool, loss_fn
    ):
        routes = self._pass_routes(engine, batch, mbs, replay, record=False)
        if routes is None:
            return None, 0
        routing_replay.clear_aux_losses()
        routes.aux_factor, real_mbs = self._aux_loss_factor(mbs, loss_fn, engine.cp)
        self._bias_before = (
            [b.clone() for b in _expert_biases(engine)]
            if self.cfg.moe_router_bias_update_rate
            else []
        )
        return routes, real_mbs

    def _train_done(self, routes, batch: RolloutBatch, real_mbs: int) -> dict:
        if routes is None:
            return {}
        out = {
            **self._route_results(routes, batch),
            **routing_replay.aux_loss_metrics(routes, real_mbs),
        }
        if self.cfg.moe_router_bias_update_rate:  # moved by megatron-core's finalize_model_grads
            # collective over every rank (a pipeline stage may hold no router; TP copies weigh alike)
            total = torch.zeros(2, dtype=torch.float64)
            for a, b in zip(self._bias_before, _expert_biases(self.policy)):
                total += torch.tensor([float((b - a).abs().sum()), b.numel()], dtype=torch.float64)
            torch.distributed.all_reduce(total)
            out["moe_expert_bias_abs_change"] = float(total[0] / total[1]) if total[1] else 0.0
        return out

    def _train_metrics(self, metrics: dict, on_policy: bool) -> dict:
        """compute_logprobs' router_mismatch (the old forward's, before this RL step's updates) is what
        every optimizer step of the RL step reports, so rl_step's mean over them is that one value
        (clearing it after the first let later mini-batches report their own post-update forward's and
        the mean mixed the two). An on-policy step has no such forward: its own forward's counts stand."""
        if on_policy:
            self._route_metrics = {}
        else:
            metrics.update(
                {k: v for k, v in self._route_metrics.items() if k in ("router_mismatch",)}
            )
        return metrics

    def _aux_loss_factor(self, mbs: list[dict], loss_fn, cp: int) -> tuple[float, int]:
        """Collective over DP: (routing_replay.aux_loss_factor of this step, the step's micro-batches with
        real tokens over every DP rank). The RL loss's global count N is the loss function's own count,
        evaluated on each micro-batch's fields before the forward with the old log-probs standing in for
        this forward's (exact off policy; on policy with a mis_token / mis_seq rollout correction, which
        drops tokens by this forward's ratio, it is the count before that drop)."""
        count = real = nonempty = 0.0
        for mb in mbs:
            fields = pipeline_passes.per_token_on(mb, "cpu")
            T = fields["labels"].numel()
            guess = fields.get("old_logprobs", fields.get("rollout_logprobs", torch.zeros(T)))
            count += float(loss_fn(fields, guess.float(), torch.zeros(T))[1])
            n = float(mb["real_tokens"].sum())
            real += n
            nonempty += float(n > 0)
        count, real, nonempty = pipeline_passes.sum_over_data_parallel(
            torch.tensor([count, real, nonempty])
        ).tolist()
        # under context parallelism every CP rank returns the whole count, and megatron divides the gradients
        # by the sum over DP x CP: CP x N (context_parallel.py)
        return routing_replay.aux_loss_factor(count * cp, real), int(nonempty)


def _expert_biases(engine: MegatronEngine) -> list[torch.Tensor]:
    """This rank's routers' expert bias buffers (DeepSeek-V3's e_score_correction_bias), in module order."""
    return [
        b
        for chunk in engine.unwrapped()
        for n, b in chunk.named_buffers()
        if n.endswith("mlp.router.expert_bias")
    ]
