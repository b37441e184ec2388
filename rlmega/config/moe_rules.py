"""Mixture-of-experts rules checked the moment a config loads (called by rlmega.config.validate).

    n, k = experts(hf, "m/config.json")       # (num_experts, top-k), (0, 0) for a dense model
    lines = layout_problems(cfg) + fsdp_problems(cfg) + model_problems(cfg, n)

Each returns `field: problem. Fix: ...` lines (rlmega.config.errors.problem). The rules:
- megatron-core 0.16's expert grid: world_size % (TP x EP x PP) == 0 (expert tensor parallel = TP, its
  default), i.e. EP divides the dense data-parallel size world_size / (TP x PP); num_experts % EP == 0.
- MoE trains at TP 1: megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism,
  which rlmega does not enable.
- Expert parallelism, routing replay and router losses need an MoE model, and the megatron learner: FSDP
  trains MoE models through transformers' own layers, which have none of them.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import rlmega.config.hf_support as hf_support
from rlmega.config.errors import ConfigError, problem
from rlmega.config.schema import RLConfig

# What FSDP does with an MoE model, named in every refusal of an MoE setting under actor.backend=fsdp.
FSDP_MOE = (
    "actor.backend=fsdp trains an MoE model through transformers' own MoE layers: every rank runs all "
    "experts (FSDP2 shards their parameters like any others), routes live, and adds no router loss"
)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sizes(cfg: RLConfig) -> Tuple[int, int, int]:
    """(TP, PP, EP)."""
    p = cfg.parallelism
    return (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
    )


def experts(hf: dict, cfg_file: str) -> Tuple[int, int]:
    """(num_experts, top-k) of config.json ``hf``; (0, 0) for a dense model (no key, or null/0).
    ConfigError naming model.path when the count or num_experts_per_tok is impossible. The key holding
    the count is hf_support's (the one reader, which the model loaders use too); here its value is checked."""
    key = hf_support.expert_count_key(hf)
    if key is None:
        return 0, 0
    n, k = hf[key], hf.get("num_experts_per_tok")
    bad = [] if _positive_int(n) else [f"{key}={n!r}"]
    if not _positive_int(k):
        bad.append(f"num_experts_per_tok={k!r}")
    elif not bad and k > n:
        bad.append(f"num_experts_per_tok={k} exceeds {key}={n}")
    if bad:
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"{cfg_file}: " + ", ".join(bad) + " (a mixture of experts needs "
                    "an integer expert count >= 1 and num_experts_per_tok in [1, that count])",
                    "fix config.json, e.g. save the model again with save_pretrained",
                )
            ]
        )
    return n, k


def layout_problems(cfg: RLConfig) -> List[str]:
    """megatron-core 0.16's expert grid (parallel_state.initialize_model_parallel): expert tensor parallel
    defaults to TP, and the expert layers carve the world as TP x EP x expert-DP x PP, so world_size must be
    a multiple of TP x EP x PP (RuntimeError there: "world_size ... is not divisible by
    expert_tensor_model_pipeline_parallel size"); equivalently EP divides the dense data-parallel size
    world_size / (TP x PP). Each expert-DP rank then holds num_experts / EP experts of every MoE layer.
    Assumes the sizes passed the range checks."""
    par = cfg.parallelism
    tp, pp, ep = _sizes(cfg)
    # EP 1 is the dense rule, checked by validate; fsdp refuses EP > 1 itself (fsdp_problems)
    if ep == 1 or par.world_size % (tp * pp) or cfg.actor.backend != "megatron":
        return []
    grid = tp * ep * pp
    if par.world_size % grid == 0:
        return []
    dp = par.world_size // (tp * pp)
    return [
        problem(
            "parallelism.expert_model_parallel_size",
            f"world_size={par.world_size} is not a multiple of TP x EP x PP = {tp} x {ep} x {pp} = {grid} "
            f"(megatron-core splits the experts over EP ranks inside each data-parallel group of "
            f"DP = world_size / (TP x PP) = {dp}, with expert tensor parallel = TP)",
            f"use an expert_model_parallel_size that divides {dp}: {_divisors(dp)}, "
            f"or set parallelism.world_size to a multiple of {grid}",
        )
    ]


def fsdp_problems(cfg: RLConfig) -> List[str]:
    """actor.backend=fsdp: expert parallelism, routing replay and router losses are megatron-core's; FSDP
    would ignore them."""
    a, out = cfg.actor, []
    fix = "set actor.backend=megatron (megatron-core MoE layers), or {}"
    if cfg.parallelism.expert_model_parallel_size != 1:
        out.append(
            problem(
                "parallelism.expert_model_parallel_size",
                f"{cfg.parallelism.expert_model_parallel_size}, but {FSDP_MOE}: there is no expert "
                "parallelism",
                fix.format("parallelism.expert_model_parallel_size=1"),
            )
        )
    if cfg.algorithm.routing_replay != "none":
        out.append(
            problem(
                "algorithm.routing_replay",
                f"{cfg.algorithm.routing_replay}, but {FSDP_MOE}: there is no routing replay",
                fix.format("algorithm.routing_replay=none"),
            )
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        v = getattr(a, name)
        if isinstance(v, (int, float)) and v > 0:
            out.append(
                problem(f"actor.{name}", f"{v}, but {FSDP_MOE}", fix.format(f"actor.{name}=0"))
            )
    return out


def model_problems(cfg: RLConfig, num_experts: int, expert_bias: bool = False) -> List[str]:
    """MoE settings against the model (megatron; ``num_experts`` 0 = dense): a dense model has nothing to
    split, replay or balance; an MoE model trains at TP 1 and its experts split evenly over EP ranks."""
    par, a, alg, out = cfg.parallelism, cfg.actor, cfg.algorithm, []
    tp, pp, ep = _sizes(cfg)
    if num_experts == 0:
        dense = f"but model.path={cfg.model.path!r} is a dense model (its config.json names no routed experts)"
        for field, value, off, is_set in (
            ("parallelism.expert_model_parallel_size", ep, 1, ep != 1),
            ("algorithm.routing_replay", alg.routing_replay, "none", alg.routing_replay != "none"),
            ("actor.moe_aux_loss_coeff", a.moe_aux_loss_coeff, 0, a.moe_aux_loss_coeff > 0),
            ("actor.moe_z_loss_coeff", a.moe_z_loss_coeff, 0, a.moe_z_loss_coeff > 0),
            (
                "actor.moe_router_bias_update_rate",
                a.moe_router_bias_update_rate,
                0,
                a.moe_router_bias_update_rate > 0,
            ),
        ):
            if is_set:
                out.append(
                    problem(
                        field,
                        f"{value}, {dense}",
                        f"set {field}={off}, or point model.path at a "
                        "mixture-of-experts model (e.g. Qwen3-MoE)",
                    )
                )
        return out
    if a.moe_router_bias_update_rate > 0 and not expert_bias:
        out.append(
            problem(
                "actor.moe_router_bias_update_rate",
                f"{a.moe_router_bias_update_rate}, but "
                f"model.path={cfg.model.path!r}'s router has no correction bias to move "
                "(e_score_correction_bias: DeepSeek-V3's family)",
                "set actor.moe_router_bias_update_rate=0, or balance with actor.moe_aux_loss_coeff",
            )
        )
    if tp > 1 and not par.sequence_parallel_on:
        # megatron-core 0.16 MoELayer.forward raises ValueError when training at TP > 1 without
        # sequence_parallel (moe_layer.py); no-grad log-prob forwards would pass, the first train step not.
        out.append(
            problem(
                "parallelism.sequence_parallel",
                f"false, but model.path={cfg.model.path!r} is a mixture of experts at "
                f"tensor_model_parallel_size={tp}: megatron-core trains MoE layers at TP > 1 only "
                "under sequence parallelism",
                "set parallelism.sequence_parallel=null (on at TP > 1), or "
                "parallelism.tensor_model_parallel_size=1",
            )
        )
    if num_experts % ep:
        dp = max(1, par.world_size // (tp * pp))
        out.append(
            problem(
                "parallelism.expert_model_parallel_size",
                f"num_experts={num_experts} of model.path={cfg.model.path!r} is not divisible by "
                f"expert_model_parallel_size={ep} (each EP rank holds num_experts / EP whole experts)",
                f"use an expert_model_parallel_size that divides both num_experts={num_experts} and "
                f"DP = world_size / (TP x PP) = {dp}: {_divisors(math.gcd(num_experts, dp))}",
            )
        )
    return out
