"""Which Hugging Face models each learner (actor.backend) trains, decided from the model folder alone.

megatron: ``unsupported_reason`` (config.json alone, no imports): the Llama, Qwen2, Qwen3, Qwen3-MoE,
Mixtral, DeepSeek-V3 and Gemma 3 shapes our HF <-> Megatron mapping converts. Shared by the config preflight
(before any worker starts), ``rlmega.megatron.hf_config`` (which builds the Megatron model) and the rollout engine
(which tells vLLM the architecture), so all three refuse, or accept, the same models with the same words.

fsdp: ``transformers_reason`` (AutoModelForCausalLM has a class for the model_type and AutoConfig reads
config.json) and ``vllm_reason`` (vLLM's model registry names the class; read without importing vLLM):
any causal LM both build, no conversion.
"""

from __future__ import annotations

import json
import os

from rlmega.config.families import megatron_architectures
from rlmega.config.gemma3_layout import gemma3_reason

SUPPORTED_ARCHITECTURES = megatron_architectures()  # the family table's (rlmega/config/families.py)
# A config.json written without `architectures` (some conversion scripts, hand-made configs) still
# names its family in `model_type`; transformers' AutoModelForCausalLM maps it the same way.
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)  # multi-latent attention (megatron-core's MLA)
# a sigmoid router with e_score_correction_bias
EXPERT_BIAS_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The per-family part of the MoE weight names (the Megatron mapping, rlmega.megatron.hf_weights, and the
# preflight's safetensors check both read it): architecture -> (the HF block holding the router
# `<block>.gate` and the experts `<block>.experts.E.<name>.weight`, the expert names in (gate, up, down) order).
MOE_HF_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "DeepseekV3ForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


# config.json keys of the routed-expert count, first set wins: Qwen's published Qwen2/3-MoE configs say
# `num_experts`; transformers 5's save_pretrained writes `num_local_experts` for them (as Mixtral's does).
# the last: DeepSeek-V3's
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count_key(hf: dict) -> str | None:
    """The key of config.json ``hf`` holding its routed-expert count; None for a dense model (no key, null or 0)."""
    return next((k for k in EXPERT_COUNT_KEYS if hf.get(k) not in (None, 0)), None)


def num_experts(hf: dict) -> int:
    """Routed experts of config.json ``hf`` (0 = a dense model); the one reader of the count
    (config validation checks its value: rlmega.config.moe_rules.experts)."""
    key = expert_count_key(hf)
    return int(hf[key]) if key else 0


def architecture(hf: dict) -> str | None:
    """The supported causal-LM class ``hf`` (a config.json dict) describes, or None."""
    archs = hf.get("architectures") or []
    if not archs:  # only model_type: the family's causal-LM class, as transformers would pick
        return MODEL_TYPE_ARCHITECTURES.get(hf.get("model_type"))
    return next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)


# Keys transformers' DeepSeek-V3 class never writes (DeepseekV3Config has neither) because its router always
# computes this way, and that vLLM reads with other defaults: softmax scores, and no correction bias (its loader
# then fails on the checkpoint's `e_score_correction_bias`). DeepSeek-V3's and Kimi-K2's own config.json set both.
DEEPSEEK_ROUTER_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def engine_overrides(model_path: str) -> dict:
    """What vLLM's ``hf_overrides`` needs for the model folder, so that the engine computes what transformers
    (and rlmega's Megatron mapping) compute from the same config.json:
    - no `architectures`: vLLM would pick the family's backbone (``LlamaModel``, no LM head), so name the
      causal-LM class (any model_type transformers maps, for actor.backend=fsdp);
    - DeepSeek-V3 without `scoring_func` / `topk_method`: transformers' sigmoid router with its correction bias
      (DEEPSEEK_ROUTER_KEYS; a model saved from transformers' own config class has neither key)."""
    path = os.path.join(model_path, "config.json")
    # not a local folder: nothing to override (the preflight requires one)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        hf = json.load(f)
    if not isinstance(hf, dict):
        return {}
    out: dict = {}
    arch = architecture(hf) or causal_lm_class(hf)
    if not hf.get("architectures") and arch:
        out["architectures"] = [arch]
    if arch == "DeepseekV3ForCausalLM":
        out.update({k: v for k, v in DEEPSEEK_ROUTER_KEYS.items() if k not in hf})
    return out


def unsupported_reason(hf: dict) -> str | None:
    """None when rlmega can convert the model whose config.json is ``hf``, else why not."""
    arch = architecture(hf)
    if arch is None:
        archs = hf.get("architectures") or []
        return (
            f"unsupported architecture {archs or hf.get('model_type')!r}: rlmega's Megatron mapping converts "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (or a config.json without `architectures` whose "
            f"model_type is {' or '.join(MODEL_TYPE_ARCHITECTURES)})"
        )
    # its tanh-GELU MLP, windows, post-norms: rlmega/config/gemma3_layout.py
    if arch == "Gemma3ForCausalLM":
        return gemma3_reason(hf)
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported"
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        return "Llama with attention_bias/mlp_bias is not supported"
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and hf.get(
        "use_sliding_window"
    ):
        return f"{arch} with use_sliding_window=true is not supported"
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and hf.get("attention_bias"):
        return f"{arch} with attention_bias=true is not supported"
    if arch == "MixtralForCausalLM":
        reason = _mixtral_reason(hf)
        if reason:
            return reason
    if arch in MLA_ARCHITECTURES:
        reason = _deepseek_reason(hf)
        if reason:
            return reason
    if arch in MOE_ARCHITECTURES:
        return _moe_reason(hf, arch)
    return None


def _deepseek_reason(hf: dict) -> str | None:
    """DeepSeek-V3's shape as megatron-core 0.16.1 computes it exactly (docs/deepseek_v3_megatron.md, measured
    against transformers): each refusal is a setting where megatron-core would give other numbers with no error."""
    arch = "DeepseekV3ForCausalLM"
    if hf.get("quantization_config"):
        return (
            f"{arch} with quantization_config={str(hf['quantization_config'])[:80]}: rlmega's Megatron mapping "
            "loads bfloat16 or float32 weights (DeepSeek-V3's and Kimi-K2's published FP8 ones: convert them "
            "to bfloat16 first)"
        )
    if (
        hf.get("scoring_func", "sigmoid") != "sigmoid"
        or hf.get("topk_method", "noaux_tc") != "noaux_tc"
    ):
        return (
            f"{arch} with scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r}: rlmega's "
            "Megatron mapping takes DeepSeek-V3's sigmoid router with its correction bias (sigmoid, noaux_tc)"
        )
    if not hf.get("norm_topk_prob", True):
        return (
            f"{arch} with norm_topk_prob=false: megatron-core's sigmoid router always renormalises the top-k "
            "weights (router probabilities 2.2 off, measured): use actor.backend=fsdp"
        )
    groups, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    topk = int(hf.get("num_experts_per_tok") or 0)
    # megatron-core normalises the top-k only for k > 1; transformers' weight is then 1 x scale
    if topk == 1:
        return f"{arch} with num_experts_per_tok=1: megatron-core's sigmoid router weighs it otherwise (unnormalised)"
    if groups > 1 and topk != 2 * topk_group:
        return (
            f"{arch} with num_experts_per_tok={topk}, topk_group={topk_group}: megatron-core scores a group by "
            f"the sum of its top num_experts_per_tok // topk_group = {topk // topk_group} experts, transformers "
            "by its top 2 (30-52% of tokens routed elsewhere, measured); they agree when num_experts_per_tok = 2 x "
            "topk_group (DeepSeek-V3's 8 and 4): use actor.backend=fsdp"
        )
    if hf.get("rope_interleave", True) is False:
        return f"{arch} with rope_interleave=false is not mapped yet (its rope rows need a permutation)"
    if hf.get("attention_bias"):
        return f"{arch} with attention_bias=true is not supported"
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "yarn"):
        return f"{arch} with rope_type={kind!r}: rlmega's MLA mapping takes default or yarn RoPE"
    if kind == "yarn":
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if "attention_factor" in params or not (
            (mscale and all_dim) or (not all_dim and (mscale or 1) == 1)
        ):
            return (
                f"{arch} with yarn mscale={mscale}, mscale_all_dim={all_dim}"
                f"{', attention_factor' if 'attention_factor' in params else ''}: megatron-core's yarn scales "
                "cos/sin as transformers does only with both mscales set (DeepSeek-V3's 1 and 1), or neither"
            )
        if params.get("truncate") is False:
            return (
                f"{arch} with yarn truncate=false cannot be expressed through megatron-core's MLA"
            )
    return None


def _mixtral_reason(hf: dict) -> str | None:
    """Mixtral: full attention (a sliding window no sequence can reach is full attention too), no router
    jitter (HF multiplies the MoE input by noise in training; Megatron's forward would not)."""
    window, max_pos = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if window is not None and (max_pos is None or int(max_pos) > int(window)):
        return (
            f"MixtralForCausalLM with sliding_window={window} < max_position_embeddings={max_pos} is not "
            "supported (rlmega's Megatron attention has no sliding window): use a model whose sliding_window "
            "is null or >= max_position_embeddings"
        )
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        return (
            f"MixtralForCausalLM with router_jitter_noise={hf['router_jitter_noise']} is not supported "
            "(rlmega's Megatron router has no input jitter): set it to 0.0 in config.json"
        )
    return None


def _moe_reason(hf: dict, arch: str) -> str | None:
    """Every decoder layer routed (Qwen3-MoE's published models; Mixtral always); Qwen3-MoE's other layer
    mixes are refused."""
    if num_experts(hf) < 1:
        return f"{arch} config.json has no `num_experts` (or `num_local_experts`) >= 1"
    if int(hf.get("num_experts_per_tok", 0)) < 1:
        return f"{arch} config.json has no `num_experts_per_tok` >= 1"
    # DeepSeek: dense first_k_dense_replace layers
    if arch in ("MixtralForCausalLM", "DeepseekV3ForCausalLM"):
        return None
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        return (
            f"decoder_sparse_step={hf['decoder_sparse_step']}: rlmega's Qwen3-MoE mapping needs every layer "
            "to be an MoE layer (decoder_sparse_step=1)"
        )
    if hf.get("mlp_only_layers"):
        return (
            f"mlp_only_layers={hf['mlp_only_layers']}: rlmega's Qwen3-MoE mapping needs every layer to be an "
            "MoE layer (mlp_only_layers=[])"
        )
    return None


# --- actor.backend=fsdp: any causal LM that transformers builds and vLLM serves ----------------------


def causal_lm_class(hf: dict) -> str | None:
    """The class name vLLM will look up for config.json ``hf``: its first `architectures` entry, or, without
    one, the causal-LM class transformers' AutoModelForCausalLM maps its model_type to (None if neither)."""
    archs = hf.get("architectures") or []
    if archs and isinstance(archs, list) and isinstance(archs[0], str):
        return archs[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.get("model_type"))
    return name if isinstance(name, str) else None


def transformers_reason(path: str, hf: dict) -> str | None:
    """None when ``AutoModelForCausalLM`` can build the model of folder ``path`` (config.json ``hf``), else why
    not. Reads config.json through ``AutoConfig`` (its checks run), builds no weights, contacts no hub."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"model_type={model_type!r} (architectures {hf.get('architectures')}) is not a causal LM the "
            "installed transformers builds (AutoModelForCausalLM has no class for it; remote code is not run)"
        )
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises ValueError, TypeError, StrictDataclass errors, ...
        return (
            f"transformers cannot read its config.json as a {model_type!r} config: {str(e)[:300]}"
        )
    return None


def _vllm_registry_file() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locates the package without importing it (seconds)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(
        list(spec.submodule_search_locations)[0], "model_executor", "models", "registry.py"
    )


def vllm_attention_backends() -> frozenset | None:
    """The names ``rollout.attention_backend`` may take: the members of vLLM's AttentionBackendEnum, read from
    vllm/v1/attention/backends/registry.py without importing vLLM (as ``vllm_architectures``). vLLM upper-cases
    the name it is given (config/attention.py). None when vLLM is absent or the file has another shape;
    tests/unit/test_config.py checks the result against the installed vLLM."""
    import ast

    registry = _vllm_registry_file()
    path = registry and os.path.join(
        os.path.dirname(registry), "..", "..", "v1", "attention", "backends", "registry.py"
    )
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AttentionBackendEnum":
            names = {
                t.id
                for n in node.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            return frozenset(names) or None
    return None


def vllm_architectures() -> frozenset | None:
    """The architectures vLLM's model registry names (``ModelRegistry.get_supported_archs()``), read from
    vllm/model_executor/models/registry.py's ``_VLLM_MODELS`` literal without importing vLLM (seconds, and
    process-wide state). None when vLLM is not installed or the file has another shape;
    tests/unit/test_config.py checks the result against the installed vLLM."""
    import ast

    path = _vllm_registry_file()
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read())
    dicts: dict = {}
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else node.target
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Dict):
            dicts[target.id] = node.value
    top = dicts.get("_VLLM_MODELS")
    if top is None:
        return None
    names = set()
    for key, value in zip(top.keys, top.values):
        parts = [dicts.get(value.id)] if key is None and isinstance(value, ast.Name) else [top]
        if parts[0] is None:
            return None
        for d in parts:
            names.update(
                k.value for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
    return frozenset(names)


def vllm_reason(hf: dict) -> str | None:
    """None when vLLM's model registry has the model's class (or vLLM is absent: nothing to ask), else why not."""
    archs = vllm_architectures()
    if archs is None:
        return None
    name = causal_lm_class(hf)
    if name in archs:
        return None
    return (
        f"vLLM (the rollout engine) does not serve {name or hf.get('model_type')!r}: its model registry "
        "has no such architecture"
    )
