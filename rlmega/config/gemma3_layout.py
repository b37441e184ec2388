"""Gemma 3's attention layout from its config.json alone (no imports): which layers slide, over how many tokens,
and each kind's RoPE; and what rlmega's Megatron mapping of it refuses (rlmega/megatron/gemma3.py builds it).

    layout = gemma3_layout(hf)      # Gemma3Layout(sliding=[True, ...], window=512, ...)
    why = gemma3_reason(hf)         # None, or why the Megatron learner refuses the model

Both config forms: transformers 5's (``layer_types``; ``rope_parameters`` keyed by layer type) and transformers 4's,
as Google's checkpoints ship it (``sliding_window_pattern``: every pattern-th layer global; ``rope_theta`` and
``rope_scaling`` of the global layers, ``rope_local_base_freq`` of the sliding ones).
"""

from __future__ import annotations

import dataclasses

ARCH = "Gemma3ForCausalLM"
_KINDS = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Gemma3Layout:
    sliding: tuple[bool, ...]  # per decoder layer: a sliding-window layer (else global)
    # transformers' sliding_window: a query sees itself and the window - 1 tokens before it
    window: int
    global_theta: float
    # "linear" RoPE scaling of the global layers (Gemma 3 4B+), else None
    global_linear_factor: float | None
    sliding_theta: float
    query_pre_attn_scalar: float  # the softmax scale is its inverse square root
    hidden_size: int

    @property
    # transformers' Gemma3TextScaledWordEmbedding: sqrt(hidden_size)
    def embedding_scale(self) -> float:
        return self.hidden_size**0.5


def _layer_types(hf: dict) -> list:
    types = hf.get("layer_types")
    if types:
        return list(types)
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(int(hf["num_hidden_layers"]))
    ]


def _ropes(hf: dict) -> tuple[dict, dict]:
    """(global, sliding) RoPE parameters, each {"rope_type", "rope_theta", ...}."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(k in params for k in _KINDS):
        full = params.get("full_attention") or {}
        return full, params.get("sliding_attention") or full
    full = dict(hf.get("rope_scaling") or {})
    full.setdefault("rope_type", full.get("type", "default"))
    full["rope_theta"] = hf.get("rope_theta", 1_000_000.0)
    return full, {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}


def gemma3_reason(hf: dict) -> str | None:
    """None when rlmega's Megatron mapping computes the Gemma 3 model of config.json ``hf`` as transformers does."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        return f"{ARCH} with hidden_activation={act!r}: rlmega's mapping takes gelu_pytorch_tanh (Gemma 3's)"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            return f"{ARCH} with {key}={hf[key]}: soft-capping is not built on the Megatron learner (Gemma 3 has none)"
    if hf.get("use_bidirectional_attention"):
        return f"{ARCH} with use_bidirectional_attention=true is not a causal LM rlmega trains"
    if hf.get("attention_bias"):
        return f"{ARCH} with attention_bias=true is not supported"
    types = _layer_types(hf)
    if len(types) != int(hf["num_hidden_layers"]) or any(t not in _KINDS for t in types):
        return f"{ARCH} with layer_types={types}: rlmega's mapping takes {' and '.join(_KINDS)} layers, one per layer"
    full, sliding = _ropes(hf)
    kinds = full.get("rope_type", "default"), sliding.get("rope_type", "default")
    if kinds[0] not in ("default", "linear") or kinds[1] != "default":
        return (
            f"{ARCH} with RoPE types {full.get('rope_type')!r} (global layers), {sliding.get('rope_type')!r} "
            "(sliding layers): rlmega's mapping takes default or linear on the global layers, default on the "
            "sliding ones"
        )
    if "sliding_attention" in types and "sliding_window" in hf and not hf["sliding_window"]:
        return f"{ARCH} with sliding layers but sliding_window={hf.get('sliding_window')!r}"
    return None


def gemma3_layout(hf: dict) -> Gemma3Layout:
    """The layout of a model ``gemma3_reason`` accepts."""
    full, sliding = _ropes(hf)
    linear = float(full["factor"]) if full.get("rope_type") == "linear" else None
    # absent keys take Gemma3TextConfig's defaults
    return Gemma3Layout(
        sliding=tuple(t == "sliding_attention" for t in _layer_types(hf)),
        window=int(hf.get("sliding_window", 4096)),
        global_theta=float(full.get("rope_theta", 1e6)),
        global_linear_factor=linear,
        sliding_theta=float(sliding.get("rope_theta", 1e4)),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        hidden_size=int(hf["hidden_size"]),
    )
