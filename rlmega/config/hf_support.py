"""Which Hugging Face models rlmega converts, decided from config.json alone (no imports).

Shared by the config preflight (before any worker starts) and ``rlmega.megatron.hf_config``
(which builds the Megatron model), so both refuse the same models with the same words.
"""
from __future__ import annotations

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported_reason(hf: dict) -> str | None:
    """None when rlmega can convert the model whose config.json is ``hf``, else why not."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        return (f"unsupported architecture {archs or hf.get('model_type')!r}: rlmega converts "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported"
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        return "Llama with attention_bias/mlp_bias is not supported"
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        return "Qwen2 with use_sliding_window=true is not supported"
    return None
