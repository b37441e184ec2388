"""The rules of a learner's own sections, checked the moment a config loads (used by
rlmega.config.validate for the actor and by rlmega.config.critic_rules for the critic).

    lines = grid_problems(cfg, "critic.parallelism", par) + megatron_model_problems("parallelism", par, shape)

Each check takes the section and its name (``parallelism`` or ``critic.parallelism``), so a problem names the
field the user set, and returns `field: problem. Fix: ...` lines (rlmega.config.errors.problem). The rules:
- the layout: VPP needs PP (megatron), world_size a multiple of TP x PP, a sample for every DP rank (and at
  least PP of them per rank under the interleaved schedule);
- actor.backend=fsdp has no tensor, pipeline or virtual pipeline split;
- megatron shards heads and KV heads over TP and layers over PP x VPP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from rlmega.config.errors import problem
from rlmega.config.schema import ParallelismConfig, RLConfig


@dataclass(frozen=True)
class ModelShape:
    """What the load-time checks read from a model's config.json (rlmega.config.validate.read_model_shape)."""

    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    hidden_size: int
    head_dim: int
    head_dim_derived: bool  # True when head_dim = hidden_size // num_attention_heads
    max_position_embeddings: Optional[int]
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    moe_topk: int = 0  # experts each token is routed to (num_experts_per_tok); 0 = dense
    # a router with a correction bias (DeepSeek-V3's e_score_correction_bias)
    expert_bias: bool = False
    # multi-latent attention's cached width per token (kv_lora_rank + qk_rope_head_dim); 0 = none
    mla_width: int = 0


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sizes(par: ParallelismConfig) -> Tuple[int, int, int]:
    """(TP, PP, VPP) with VPP None counted as 1 (no interleaving)."""
    vpp = par.virtual_pipeline_model_parallel_size or 1
    return par.tensor_model_parallel_size, par.pipeline_model_parallel_size, vpp


def grid_problems(cfg: RLConfig, sec: str, par: ParallelismConfig) -> List[str]:
    """One learner's layout, ``par`` named ``sec`` (the actor's parallelism, or critic.parallelism): VPP needs
    PP (megatron; fsdp refuses VPP itself), world_size a multiple of TP x PP, a sample for every DP rank."""
    out = []
    tp, pp, vpp = sizes(par)
    # fsdp: fsdp_layout_problems names it
    if vpp > 1 and pp == 1 and cfg.actor.backend == "megatron":
        out.append(
            problem(
                f"{sec}.virtual_pipeline_model_parallel_size",
                f"virtual pipeline size {vpp} needs pipeline_model_parallel_size > 1",
                f"set {sec}.pipeline_model_parallel_size >= 2, "
                f"or {sec}.virtual_pipeline_model_parallel_size=null",
            )
        )
    # fsdp: fsdp_layout_problems
    if par.sequence_parallel and tp == 1 and cfg.actor.backend == "megatron":
        out.append(
            problem(
                f"{sec}.sequence_parallel",
                "true, but tensor_model_parallel_size=1: sequence parallelism "
                "splits a micro-batch's tokens over the TP ranks, and there is one",
                f"set {sec}.sequence_parallel=null (on exactly when TP > 1), or "
                f"{sec}.tensor_model_parallel_size > 1",
            )
        )
    cp = par.context_parallel_size
    if par.world_size % (tp * pp * cp):
        grid = tp * pp * cp
        out.append(
            problem(
                f"{sec}.world_size",
                f"world_size={par.world_size} is not a multiple of TP x PP"
                + (f" x CP = {tp} x {pp} x {cp}" if cp > 1 else f" = {tp * pp}"),
                f"set {sec}.world_size to a multiple of {grid} (e.g. {grid}, {2 * grid})",
            )
        )
    else:
        out += micro_batch_problems(cfg, par.data_parallel_size, pp, vpp, sec)
    return out


def micro_batch_problems(
    cfg: RLConfig, dp: int, pp: int, vpp: int, sec: str = "parallelism"
) -> List[str]:
    """What ``plan_micro_batches`` would refuse mid-run, checked at load.

    Each optimizer step's samples are balanced over the DP ranks (the least loaded gets
    floor(batch / DP)), and every rank needs one sample; Megatron's interleaved schedule (VPP > 1)
    needs each rank's micro-batch count to be a multiple of PP, i.e. at least PP one-sample
    micro-batches. The supervised warm start (the policy's: ``sec`` parallelism) trains on batches of
    prompts_per_step prompts.
    """
    tr, out = cfg.trainer, []
    need, of = (pp if vpp > 1 else 1), ("" if sec == "parallelism" else f" of {sec}")
    why = (
        f"the interleaved pipeline schedule (VPP={vpp}) needs at least PP={pp} micro-batches of one sample "
        f"on each of the DP={dp} ranks{of}"
        if vpp > 1
        else f"each of the DP={dp} data-parallel ranks{of} needs a sample"
    )
    batches = [("trainer.global_batch_size", tr.global_batch_size, "samples per optimizer step")]
    if tr.warmup_sft_steps and sec == "parallelism":
        batches.append(
            ("trainer.prompts_per_step", tr.prompts_per_step, "prompts per warm-start step")
        )
    for field, size, what in batches:
        if size // dp < need:
            out.append(
                problem(
                    field,
                    f"{field.split('.')[1]}={size} {what}: {why}",
                    f"set {field} >= {need * dp}"
                    + (
                        f", or disable interleaving ({sec}.virtual_pipeline_model_parallel_size=null)"
                        if vpp > 1
                        else f", or use fewer data-parallel ranks{of}"
                    ),
                )
            )
    return out


def fsdp_layout_problems(sec: str, par: ParallelismConfig) -> List[str]:
    """actor.backend=fsdp: ``par`` (named ``sec``) has no tensor, pipeline or virtual pipeline split."""
    out = []
    fix = (
        f"FSDP2 shards the parameters over all {sec}.world_size ranks instead; or set "
        "actor.backend=megatron for tensor/pipeline parallelism (the models rlmega/config/hf_support.py maps)"
    )
    for name, value in (
        ("tensor_model_parallel_size", par.tensor_model_parallel_size),
        ("pipeline_model_parallel_size", par.pipeline_model_parallel_size),
    ):
        if value != 1:
            out.append(
                problem(
                    f"{sec}.{name}",
                    f"{value}, but actor.backend=fsdp has no {name.split('_model')[0]} parallelism",
                    f"set {sec}.{name}=1: {fix}",
                )
            )
    if par.sequence_parallel:
        out.append(
            problem(
                f"{sec}.sequence_parallel",
                "true, but actor.backend=fsdp has no tensor parallelism to "
                "split sequences over (its long-context split is Ulysses)",
                f"set {sec}.sequence_parallel=null: {fix}",
            )
        )
    if par.context_parallel_size > 1:
        out.append(
            problem(
                f"{sec}.context_parallel_size",
                f"{par.context_parallel_size}, but actor.backend=fsdp "
                "has no context parallelism (its long-context split is Ulysses: actor.ulysses_size)",
                f"set {sec}.context_parallel_size=1 (actor.ulysses_size > 1 instead), or "
                "actor.backend=megatron",
            )
        )
    vpp = par.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1:
        out.append(
            problem(
                f"{sec}.virtual_pipeline_model_parallel_size",
                f"{vpp}, but actor.backend=fsdp has no pipeline to interleave",
                f"set {sec}.virtual_pipeline_model_parallel_size=null: {fix}",
            )
        )
    return out


def megatron_model_problems(sec: str, par: ParallelismConfig, shape: ModelShape) -> List[str]:
    """Megatron's sharding of the model: heads and KV heads over TP, layers over PP x VPP (``par``, named ``sec``)."""
    out = []
    tp, pp, vpp = sizes(par)
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    valid_tp = divisors(math.gcd(heads, kv))
    if heads % tp:
        out.append(
            problem(
                f"{sec}.tensor_model_parallel_size",
                f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}",
                f"use a tensor_model_parallel_size in {valid_tp}",
            )
        )
    if kv % tp:  # Megatron shards KV heads as num_query_groups; it needs num_query_groups % TP == 0
        out.append(
            problem(
                f"{sec}.tensor_model_parallel_size",
                f"num_key_value_heads={kv} (Megatron's num_query_groups) is not divisible by "
                f"tensor_model_parallel_size={tp}",
                f"use a tensor_model_parallel_size in {valid_tp}",
            )
        )
    if shape.num_hidden_layers % (pp * vpp):
        out.append(
            problem(
                f"{sec}.pipeline_model_parallel_size",
                f"num_hidden_layers={shape.num_hidden_layers} is not divisible by "
                f"PP x VPP = {pp} x {vpp} "
                "(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)",
                f"choose PP x VPP in {divisors(shape.num_hidden_layers)}",
            )
        )
    return out
