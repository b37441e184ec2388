"""The critic's rules (algorithm.advantage_estimator=gae), checked the moment a config loads (called by
rlmega.config.validate) and against this machine (called by rlmega.preflight).

    rules = ranges(cfg)                                   # gae's and the critic section's (field, ok, rule)
    lines = section_problems(cfg) + model_problems(cfg, own_shape, policy_shape)
    lines = folder_problems(cfg)                          # preflight: the folder the critic starts from

Each returns `field: problem. Fix: ...` lines (rlmega.config.errors.problem). The rules:
- gamma, lam, lam_critic, lam_actor_alpha and the critic section hold their ranges whatever the estimator
  (a value is wrong or not); the rest apply only with gae, where the other estimators' only refusal is a
  critic warm-up, which would do nothing.
- The critic's optimizer and layout (critic.parallelism, else the actor's) obey the actor's rules
  (rlmega/config/learner_rules.py), named critic.*, its layout against its own model (critic.path, else
  model.path); an MoE critic runs without expert parallelism, at TP > 1 under sequence parallelism.
- critic.path (preflight) is a critic's export (XForTokenClassification with a score.weight [1, hidden]) or a
  causal LM of the policy's hidden_size, num_hidden_layers and vocab_size, with safetensors weights.
- The critic's ranks (critic_ranks) are a worker group of their own: placement, CPUs and memory count them.
"""

from __future__ import annotations

import glob
import json
import os
from typing import List, Optional

from rlmega.config.errors import problem
from rlmega.config.families import fsdp_reason
from rlmega.config.hf_support import transformers_reason, unsupported_reason
from rlmega.config.learner_rules import (
    ModelShape,
    fsdp_layout_problems,
    grid_problems,
    megatron_model_problems,
)
from rlmega.config.model_files import HeaderError, read_safetensors_header, weight_problems
from rlmega.config.schema import RLConfig


def critic_ranks(cfg: RLConfig) -> int:
    """The critic's ranks (its own worker group, algorithm.advantage_estimator=gae); 0 without a critic."""
    return (
        (cfg.critic.parallelism or cfg.parallelism).world_size
        if cfg.algorithm.advantage_estimator == "gae"
        else 0
    )


def section_problems(cfg: RLConfig) -> List[str]:
    """The critic section against the run, with algorithm.advantage_estimator=gae (other estimators do not
    read it: only a warm-up, which would then do nothing, is refused). Assumes the ranges hold."""
    c, est, out = cfg.critic, cfg.algorithm.advantage_estimator, []
    steps = cfg.trainer.total_steps
    if est != "gae":
        if c.warmup_steps > 0:
            out.append(
                problem(
                    "critic.warmup_steps",
                    f"{c.warmup_steps}, but algorithm.advantage_estimator={est} "
                    "has no critic to warm up: the policy would just wait",
                    "set critic.warmup_steps=0, or algorithm.advantage_estimator=gae",
                )
            )
        return out
    if c.warmup_steps >= steps:
        out.append(
            problem(
                "critic.warmup_steps",
                f"{c.warmup_steps} steps of critic-only warm-up, but the run has "
                f"trainer.total_steps={steps}: warm-up longer than the run, the policy would never train",
                f"set critic.warmup_steps < {steps} (e.g. {steps // 4}), or raise trainer.total_steps",
            )
        )
    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    budget = c.max_tokens_per_micro_batch
    if budget is not None and budget < longest:
        out.append(
            problem(
                "critic.max_tokens_per_micro_batch",
                f"{budget} tokens per micro-batch, but one sample may have "
                f"rollout.max_prompt_tokens + rollout.max_response_tokens = {longest}",
                f"set critic.max_tokens_per_micro_batch >= {longest} (or null: the actor's)",
            )
        )
    no_ep = "an MoE critic runs without expert parallelism (its experts are not split over ranks)"
    if c.parallelism is None:
        ep = cfg.parallelism.expert_model_parallel_size
        if ep > 1:
            out.append(
                problem(
                    "critic.parallelism",
                    f"null, so the critic takes the actor's parallelism with "
                    f"expert_model_parallel_size={ep}, but {no_ep}",
                    "give the critic a layout of its own with expert_model_parallel_size=1, e.g. "
                    "critic.parallelism={tensor_model_parallel_size: 1, pipeline_model_parallel_size: "
                    f"1, world_size: {cfg.parallelism.world_size}}}",
                )
            )
        return out
    sec = "critic.parallelism"
    if c.parallelism.expert_model_parallel_size > 1:
        out.append(
            problem(
                f"{sec}.expert_model_parallel_size",
                f"{c.parallelism.expert_model_parallel_size}, but {no_ep}",
                f"set {sec}.expert_model_parallel_size=1",
            )
        )
    if cfg.actor.backend == "fsdp":
        out += fsdp_layout_problems(sec, c.parallelism)
    return out + grid_problems(cfg, sec, c.parallelism)


def shape_path(cfg: RLConfig) -> str:
    """The folder whose config.json gives the critic a shape of its own: critic.path with gae where it has a
    config.json, else "" (whether critic.path is a usable folder at all is the preflight's question)."""
    path = cfg.critic.path
    gae = cfg.algorithm.advantage_estimator == "gae"
    return path if gae and path and os.path.isfile(os.path.join(path, "config.json")) else ""


def model_problems(
    cfg: RLConfig, own: Optional[ModelShape], policy: Optional[ModelShape]
) -> List[str]:
    """gae, megatron: the critic's layout (critic.parallelism, else the actor's) against its model (``own``,
    shape_path's, with critic.path set, else the ``policy``'s), unless that pair is the actor's own (already
    checked). Nothing where the shape is unread (the preflight says why). Assumes the ranges hold."""
    if cfg.algorithm.advantage_estimator != "gae":
        return []
    shape, par = (own if cfg.critic.path else policy), cfg.critic.parallelism
    if shape is None or cfg.actor.backend != "megatron" or (par is None and shape == policy):
        return []
    sec, par = "critic.parallelism", par or cfg.parallelism
    out = megatron_model_problems(sec, par, shape)
    if shape.num_experts and par.tensor_model_parallel_size > 1 and not par.sequence_parallel_on:
        # megatron-core 0.16 MoELayer.forward raises when training at TP > 1 without sequence parallelism
        out.append(
            problem(
                f"{sec}.sequence_parallel",
                f"false, but the critic's model is a mixture of experts at "
                f"tensor_model_parallel_size={par.tensor_model_parallel_size}: megatron-core trains MoE "
                "layers at TP > 1 only under sequence parallelism",
                f"set {sec}.sequence_parallel=null (on at TP > 1), or {sec}.tensor_model_parallel_size=1",
            )
        )
    return out


def folder_problems(cfg: RLConfig) -> List[str]:
    """Preflight, gae: the folder the critic starts from (critic.path, else model.path) builds a value model of
    the policy's shape. critic.path: a critic's export (XForTokenClassification, its score.weight [1, hidden])
    or a causal LM (its body), whose architecture the learner takes, with the policy's hidden_size,
    num_hidden_layers and vocab_size (the critic reads the policy's tokens), and safetensors weights."""
    if cfg.algorithm.advantage_estimator != "gae":
        return []
    path, fix = (
        cfg.critic.path,
        (
            "point critic.path at a critic's export (e.g. RUN_DIR/critic_hf_final) or a "
            "causal LM folder of the policy's shape, or leave it empty (model.path)"
        ),
    )
    if not path:
        return (
            _token_classification("model.path", cfg.model.path, cfg)
            if cfg.actor.backend == "fsdp"
            else []
        )
    if not os.path.isdir(path):
        return [problem("critic.path", f"{path!r} is not a folder", fix)]
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        return [problem("critic.path", f"cannot read {path}/config.json: {e}", fix)]
    if not isinstance(hf, dict):
        return [
            problem(
                "critic.path",
                f"{path}/config.json holds a JSON {type(hf).__name__}, not an object",
                fix,
            )
        ]
    # imports torch: only here
    from rlmega.config.value_model import causal_lm_config, is_value_model

    value = is_value_model(hf)
    causal = causal_lm_config(hf) if value else hf
    archs = hf.get("architectures") or []
    kinds = ("ForCausalLM", "ForTokenClassification")
    why = (
        f"architectures {archs} names neither a causal LM nor a value model (XForTokenClassification)"
        if archs and not any(a.endswith(kinds) for a in archs)
        else unsupported_reason(causal)
        if cfg.actor.backend == "megatron"
        else transformers_reason(path, causal)
    )
    if why:
        return [problem("critic.path", f"{path!r}: {why}", fix)]
    out = _token_classification("critic.path", path, cfg, hf) if cfg.actor.backend == "fsdp" else []
    refused = (
        fsdp_reason(
            causal,
            cfg.model.dtype,
            "cuda",
            cfg.actor.ulysses_size,  # "cuda": no engine serves it
            cfg.model.allow_untested_family,
        )
        if cfg.actor.backend == "fsdp" and not out
        else None
    )
    if refused:
        return [
            problem(
                "critic.path" if refused[0] == "model.path" else refused[0],
                f"{refused[1]} (critic.path={path!r})",
                refused[2],
            )
        ]
    return out + _shape_problems(cfg, path, hf) + _weight_problems(path, hf, value)


def _shape_problems(cfg: RLConfig, path: str, hf: dict) -> List[str]:
    """critic.path's config.json ``hf`` against the policy's (model.path's): the critic is the policy's
    architecture and scores the policy's tokens."""
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            policy = json.load(f)
    except (OSError, ValueError):
        return []  # model.path's own check names it
    out = []
    for key in (
        ("hidden_size", "num_hidden_layers", "vocab_size") if isinstance(policy, dict) else ()
    ):
        if hf.get(key) != policy.get(key):
            out.append(
                problem(
                    "critic.path",
                    f"{key}={hf.get(key)} in {path}/config.json, but model.path's "
                    f"{key}={policy.get(key)}: the critic is the policy's architecture and scores the "
                    "policy's tokens",
                    "use a critic made from this policy (or from a model of its "
                    "shape and vocabulary), or leave critic.path empty",
                )
            )
    return out


def _weight_problems(path: str, hf: dict, value: bool) -> List[str]:
    """critic.path's safetensors: a causal LM's must match its config.json; a value model's (``value``) must hold
    its value head score.weight [1, hidden_size]."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return [
            problem(
                "critic.path",
                f"{path!r} has no *.safetensors weights",
                "save the critic or model "
                "into that folder with save_pretrained (safetensors), or the critic's export_hf",
            )
        ]
    if not value:
        return [
            problem(
                "critic.path", why, "save the model again with save_pretrained, or fix config.json"
            )
            for why in weight_problems(path, hf)
        ]
    try:
        head = {k: v for f in files for k, v in read_safetensors_header(f).items()}.get(
            "score.weight"
        )
    except (HeaderError, OSError) as e:
        return [
            problem(
                "critic.path",
                f"a weights file is not a complete safetensors file: {e}",
                "export the critic again (export_hf)",
            )
        ]
    if head is None or head[1] != [1, hf.get("hidden_size")]:
        return [
            problem(
                "critic.path",
                f"config.json names a value model, but its weights have "
                f"{'no score.weight' if head is None else f'score.weight {head[1]}'} (a value head is "
                f"[1, hidden_size={hf.get('hidden_size')}])",
                "export the critic again (export_hf), or "
                "point critic.path at the causal LM it was made from (a fresh value head is drawn)",
            )
        ]
    return []


def _token_classification(
    field: str, path: str, cfg: RLConfig, hf: dict | None = None
) -> List[str]:
    """actor.backend=fsdp builds the critic as transformers' AutoModelForTokenClassification of the folder's
    model_type; [] where that has a class (or model.path's own check already refuses the folder)."""
    if hf is None:
        try:
            with open(os.path.join(path, "config.json")) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return []
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES as names,
    )

    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if model_type is None or model_type in names:
        return []
    return [
        problem(
            field,
            f"{path!r}: the critic of algorithm.advantage_estimator=gae on actor.backend=fsdp is "
            "transformers' AutoModelForTokenClassification, which has "
            f"no class for model_type={model_type!r}",
            "use actor.backend=megatron, or a model family with an "
            "XForTokenClassification in transformers (e.g. Llama, Qwen2, Qwen3), or "
            "algorithm.advantage_estimator other than gae",
        )
    ]
