"""LoRA's rules (actor.lora, rollout.lora_merge), checked the moment a config loads (called by
rlmega.config.validate) and against the model's folder (called by rlmega.preflight).

    lines = problems(cfg)                                 # against the rest of the config
    lines = module_problems(cfg, hf)                      # preflight: target_modules against the model
    lines = resume_problems(cfg, step_folder)             # trainer.resume's checkpoint against actor.lora

- Declared beside the fields (schema.py): rank >= 0 (0 = off), alpha > 0, dropout 0 (a log-prob must be a
  function of the weights), a non-empty target_modules list.
- With rank > 0 on actor.backend=megatron: target_modules among MEGATRON_TARGETS (the attention's only for an
  MoE model: expert LoRA is not built, preflight). On both learners the reference is the base model (the
  policy with its adapters off), so a Polyak-moved reference (actor.ref_update_rate > 0) and a KL anchored to
  a warm-started policy (trainer.warmup_sft_steps > 0 with a KL term) cannot be had.
- Served unmerged (rollout.lora_merge false, the default): vLLM serves ranks up to 512, and the model's vLLM
  class must take adapters (preflight; else rollout.lora_merge=true merges them on the trainer).
- rollout.lora_merge=true without adapters would do nothing: refused.
- Each target module names a linear layer of model.path's model (read on the meta device: no weights).
- A checkpoint to resume from holds the same adapters, or none (a full-parameter checkpoint becomes a LoRA
  run's base: both learners' checkpoint.py); a LoRA checkpoint does not resume a full-parameter run.
"""

from __future__ import annotations

from typing import List

from rlmega.config.errors import problem
from rlmega.config.schema import LoraConfig, RLConfig

# vllm 0.32's LoRAConfig.max_lora_rank choices (vllm/config/lora.py MaxLoRARanks;
# tests/unit/test_lora_rules_and_streams.py holds it to the installed vllm): an engine serves an adapter in the
# smallest slot that holds its rank
LORA_SLOT_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What the Megatron learner adapts (rlmega/megatron/lora_adapters.py's SITES: megatron-core's fused linear_qkv,
# linear_proj, linear_fc1, linear_fc2 split into their HF modules); of an MoE model, the attention's only
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
MEGATRON_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def problems(cfg: RLConfig) -> List[str]:
    """actor.lora and rollout.lora_merge against the rest of the config (assumes the section's ranges hold)."""
    lora, out = cfg.actor.lora, []
    if lora.rank == 0:
        if cfg.rollout.lora_merge:
            out.append(
                problem(
                    "rollout.lora_merge",
                    "true, but actor.lora.rank=0: there are no adapters to merge",
                    "set rollout.lora_merge=false, or actor.lora.rank > 0",
                )
            )
        return out
    if cfg.actor.backend == "megatron":
        other = [m for m in lora.target_modules if m not in MEGATRON_TARGETS]
        if other:
            out.append(
                problem(
                    "actor.lora.target_modules",
                    f"{other}: the Megatron learner adapts the attention and "
                    f"MLP projections by their HF names {list(MEGATRON_TARGETS)}",
                    "list modules from those, or use actor.backend=fsdp (peft's LoRA on any linear layer)",
                )
            )
    if cfg.actor.ref_update_rate > 0:
        out.append(
            problem(
                "actor.ref_update_rate",
                f"{cfg.actor.ref_update_rate}, but with actor.lora the reference "
                "policy is the base model (the policy with its adapters off): it cannot move",
                "set actor.ref_update_rate=0, or actor.lora.rank=0",
            )
        )
    kl = cfg.algorithm.kl_coef > 0
    if cfg.trainer.warmup_sft_steps > 0 and kl:
        out.append(
            problem(
                "trainer.warmup_sft_steps",
                f"{cfg.trainer.warmup_sft_steps} warm-start steps with a KL "
                f"term (algorithm.kl_coef={cfg.algorithm.kl_coef}), but with actor.lora the reference "
                "is the base model, not the warm-started policy the KL would anchor to without LoRA",
                "set algorithm.kl_coef=0, or trainer.warmup_sft_steps=0, or actor.lora.rank=0",
            )
        )
    slot = LORA_SLOT_RANKS[-1]
    if not cfg.rollout.lora_merge and lora.rank > slot:
        out.append(
            problem(
                "actor.lora.rank",
                f"{lora.rank}, but vLLM serves adapters up to rank {slot}",
                f"set actor.lora.rank <= {slot}, or rollout.lora_merge=true (the trainer merges the "
                "adapters into the weights it syncs)",
            )
        )
    return out


def module_problems(cfg: RLConfig, hf: dict) -> List[str]:
    """Preflight, actor.lora on: each of target_modules names a linear layer of model.path's model (its
    config.json ``hf``, built on the meta device); served unmerged, vLLM's class of it takes adapters."""
    if cfg.actor.lora.rank == 0:
        return []
    out = [] if cfg.rollout.lora_merge else _engine_problems(hf)
    # its targets are checked against MEGATRON_TARGETS (problems)
    if cfg.actor.backend == "megatron":
        from rlmega.config.hf_support import MLA_ARCHITECTURES, architecture, num_experts

        # its attention has no q/k/v/o projections to adapt
        if architecture(hf) in MLA_ARCHITECTURES:
            return out + [
                problem(
                    "actor.lora.rank",
                    f"{cfg.actor.lora.rank}, but model.path's model has multi-latent "
                    "attention (DeepSeek-V3): the Megatron learner's LoRA on it is not built",
                    "set actor.lora.rank=0, or actor.backend=fsdp (peft adapts any linear there)",
                )
            ]
        mlp = [m for m in cfg.actor.lora.target_modules if m in MLP_TARGETS]
        if mlp and num_experts(hf):
            out.append(
                problem(
                    "actor.lora.target_modules",
                    f"{mlp}, but model.path's model is a mixture of experts: "
                    "the Megatron learner's LoRA on MoE experts is not built",
                    f"adapt the attention only ({', '.join(ATTENTION_TARGETS)})",
                )
            )
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # the architecture's own checks (preflight._model) say why
        return out
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), "").rsplit(".", 1)[-1]
    if head_name and head_name in cfg.actor.lora.target_modules:
        # the chunked log-probs compute logits from the head's weight (its base alone under LoRA), and vLLM
        # does not take adapters on it: refused rather than a head adapter the numbers would skip
        out.append(
            problem(
                "actor.lora.target_modules",
                f"{head_name!r} is the model's output layer: LoRA adapts "
                "the decoder's linear layers only",
                f"leave {head_name} out of actor.lora.target_modules",
            )
        )
    linear = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name and m is not head
        }
    )
    missing = [m for m in cfg.actor.lora.target_modules if m not in linear and m != head_name]
    if not missing:
        return out
    return out + [
        problem(
            "actor.lora.target_modules",
            f"{missing} name no linear layer of model.path's "
            f"{type(model).__name__} (its linear layers: {linear})",
            "list module names from those, e.g. the attention and MLP projections",
        )
    ]


def _engine_problems(hf: dict) -> List[str]:
    """The rollout engine's model class takes LoRA adapters (vLLM's SupportsLoRA; imports vLLM: seconds)."""
    from rlmega.config.hf_support import causal_lm_class

    name = causal_lm_class(hf)
    try:
        from vllm.model_executor.models.interfaces import supports_lora
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:  # no vLLM here: nothing to ask (preflight names a missing engine elsewhere)
        return []
    cls = ModelRegistry._try_load_model_cls(name) if name else None
    if cls is None or supports_lora(cls):  # an unknown class is preflight's vllm_reason
        return []
    return [
        problem(
            "rollout.lora_merge",
            f"false, but vLLM's {name} (the rollout engine's model) cannot serve LoRA adapters",
            "set rollout.lora_merge=true: the trainer merges the adapters into the "
            "weights it syncs",
        )
    ]


def resume_problems(cfg: RLConfig, step_folder) -> List[str]:
    """trainer.resume's checkpoint (a complete step folder) against actor.lora: the learners' checkpoint rule
    (fsdp/checkpoint.py, megatron/checkpoint.py)."""
    from rlmega.rundir.checkpoint_scan import read_common

    saved = read_common(step_folder).get("meta", {}).get("lora")
    why = checkpoint_mismatch(saved, checkpoint_record(cfg.actor.lora), step_folder)
    return (
        [problem("trainer.resume", why.split(" Fix: ")[0], why.split(" Fix: ")[1])] if why else []
    )


def checkpoint_record(cfg: LoraConfig) -> dict | None:
    """What a checkpoint records of the adapters (both learners' checkpoint meta["lora"]), None without."""
    return (
        {"rank": cfg.rank, "alpha": float(cfg.alpha), "target_modules": sorted(cfg.target_modules)}
        if cfg.rank
        else None
    )


def checkpoint_mismatch(saved: dict | None, mine: dict | None, path) -> str | None:
    """Why a model with adapters ``mine`` cannot load checkpoint ``path`` of adapters ``saved`` (None: it can;
    a full-parameter checkpoint loads into a LoRA model's base)."""
    if saved is None or saved == mine:
        return None
    if mine is None:
        return (
            f"checkpoint {path} holds a LoRA run's adapters (actor.lora {saved}), but this run trains every "
            "weight (actor.lora.rank=0). Fix: resume it with the same actor.lora, or start a new run from its "
            "exported hf_final/merged"
        )
    return (
        f"checkpoint {path} holds adapters {saved}, this run's are {mine}: their shapes differ. Fix: resume "
        "it with the saved actor.lora settings"
    )
