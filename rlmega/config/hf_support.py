"""Which Hugging Face models rlmega converts, decided from config.json alone (no imports).

Shared by the config preflight (before any worker starts), ``rlmega.megatron.hf_config`` (which
builds the Megatron model) and the rollout engine (which tells vLLM the architecture), so all
three refuse, or accept, the same models with the same words.
"""
from __future__ import annotations

import json
import os

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# A config.json written without `architectures` (some conversion scripts, hand-made configs) still
# names its family in `model_type`; transformers' AutoModelForCausalLM maps it the same way.
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture(hf: dict) -> str | None:
    """The supported causal-LM class ``hf`` (a config.json dict) describes, or None."""
    archs = hf.get("architectures") or []
    if not archs:  # only model_type: the family's causal-LM class, as transformers would pick
        return MODEL_TYPE_ARCHITECTURES.get(hf.get("model_type"))
    return next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)


def architecture_overrides(model_path: str) -> dict:
    """What vLLM's ``hf_overrides`` needs for the model folder: when its config.json has no
    `architectures`, vLLM picks the family's backbone (``LlamaModel``, no LM head), so name the
    causal-LM class; else nothing."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):  # not a local folder: nothing to override (the preflight requires one)
        return {}
    with open(path) as f:
        hf = json.load(f)
    arch = architecture(hf) if isinstance(hf, dict) else None
    return {"architectures": [arch]} if arch and not hf.get("architectures") else {}


def unsupported_reason(hf: dict) -> str | None:
    """None when rlmega can convert the model whose config.json is ``hf``, else why not."""
    arch = architecture(hf)
    if arch is None:
        archs = hf.get("architectures") or []
        return (f"unsupported architecture {archs or hf.get('model_type')!r}: rlmega converts "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (or a config.json without `architectures` whose "
                f"model_type is {' or '.join(MODEL_TYPE_ARCHITECTURES)})")
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported"
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        return "Llama with attention_bias/mlp_bias is not supported"
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        return "Qwen2 with use_sliding_window=true is not supported"
    return None
