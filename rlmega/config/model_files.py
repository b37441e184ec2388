"""The files of a model folder, checked against its config.json before any worker starts.

    problems = weight_problems("runs/tiny_model", hf)     # hf: config.json as a dict
    problems += tokenizer_problems("runs/tiny_model", hf)

Weights: only each ``*.safetensors`` file's header is read (an 8-byte little-endian length, then that
much JSON), never the tensors, so a multi-GB checkpoint costs milliseconds. The header must be
well-formed and its offsets must cover the file exactly (a truncated download, or a file of zeros,
fails here); the tensor names and shapes must be those config.json implies for a Llama, Qwen2,
Qwen3 or Qwen3-MoE model (rlmega.config.hf_support), so a config that disagrees with its weights (another family, a
vocabulary or width that differs, a layer count that differs) is refused naming the first tensors
that differ. ``pytorch_model*.bin`` weights are pickles: they are not opened here.

Tokenizer: tokenizer.json is parsed with the `tokenizers` library (what transformers' fast tokenizer
uses), must encode a short text to at least one token and must not emit ids past config.json's
vocab_size. Without tokenizer.json, the slow tokenizer's files (tokenizer.model, or vocab.json with
merges.txt) must be there: tokenizer_config.json alone holds no vocabulary.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Dict, List, Tuple

from rlmega.config.hf_support import MOE_HF_NAMES, architecture, num_experts

# safetensors' own limit on the JSON header (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
# Buffers some older checkpoints saved, which no loader reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SHOWN = 3  # differences named per kind; the rest are counted


class HeaderError(ValueError):
    pass


# Files a model folder may hold its weights in (what the checks of model.path and teachers look for).
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def read_safetensors_header(path: str) -> Dict[str, Tuple[str, List[int]]]:
    """{tensor name: (dtype, shape)} of one .safetensors file, from its header only; HeaderError
    when the header is malformed or its offsets do not cover the file exactly."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):  # "{}" is the shortest header
            raise HeaderError(
                f"header length {n} is impossible for a {size}-byte file (a zero-filled or "
                "truncated file, or not safetensors)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise HeaderError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise HeaderError("the header is not a JSON object")
    out, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = (
                entry["dtype"],
                [int(d) for d in entry["shape"]],
                entry["data_offsets"],
            )
        except (TypeError, KeyError, ValueError):
            raise HeaderError(f"tensor {name!r} has no dtype, shape and data_offsets") from None
        count = 1
        for d in shape:
            count *= d
        if dtype in DTYPE_BYTES and stop - begin != count * DTYPE_BYTES[dtype]:
            raise HeaderError(
                f"tensor {name!r}: {dtype} {shape} needs {count * DTYPE_BYTES[dtype]} bytes, "
                f"its offsets give {stop - begin}"
            )
        out[name], end = (dtype, shape), max(end, stop)
    if 8 + n + end != size:
        raise HeaderError(
            f"the header describes {8 + n + end} bytes but the file has {size} "
            f"({'truncated' if size < 8 + n + end else 'trailing bytes'})"
        )
    return out


# per-head q/k RMSNorm; Qwen3-MoE adds routed experts
QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _sparse_layers(hf: dict) -> set:
    """Indices of Qwen3-MoE's expert layers (transformers' Qwen3MoeDecoderLayer rule): not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the others have a dense MLP."""
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    return {i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}


def _deepseek_layer_shapes(hf: dict, i: int) -> Dict[str, List[int]]:
    """DeepSeek-V3's tensors of decoder layer ``i`` (multi-latent attention; the first first_k_dense_replace layers
    a dense MLP, the others the router with its correction bias, the routed and the shared experts)."""
    h, heads, p = hf["hidden_size"], hf["num_attention_heads"], f"model.layers.{i}."
    nope, rope, v, kv, q = (
        hf["qk_nope_head_dim"],
        hf["qk_rope_head_dim"],
        hf["v_head_dim"],
        hf["kv_lora_rank"],
        hf.get("q_lora_rank"),
    )
    out = {
        p + "input_layernorm.weight": [h],
        p + "post_attention_layernorm.weight": [h],
        p + "self_attn.kv_a_proj_with_mqa.weight": [kv + rope, h],
        p + "self_attn.kv_a_layernorm.weight": [kv],
        p + "self_attn.kv_b_proj.weight": [heads * (nope + v), kv],
        p + "self_attn.o_proj.weight": [h, heads * v],
    }
    if q:
        out.update(
            {
                p + "self_attn.q_a_proj.weight": [q, h],
                p + "self_attn.q_a_layernorm.weight": [q],
                p + "self_attn.q_b_proj.weight": [heads * (nope + rope), q],
            }
        )
    else:
        out[p + "self_attn.q_proj.weight"] = [heads * (nope + rope), h]
    if i < int(hf.get("first_k_dense_replace") or 0):
        inter = hf["intermediate_size"]
        return {
            **out,
            p + "mlp.gate_proj.weight": [inter, h],
            p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
        }
    experts, inter = num_experts(hf), hf["moe_intermediate_size"]
    shared = inter * int(hf.get("n_shared_experts") or 0)
    out.update(
        {p + "mlp.gate.weight": [experts, h], p + "mlp.gate.e_score_correction_bias": [experts]}
    )
    for e in range(experts):
        q_ = f"{p}mlp.experts.{e}."
        out.update(
            {
                q_ + "gate_proj.weight": [inter, h],
                q_ + "up_proj.weight": [inter, h],
                q_ + "down_proj.weight": [h, inter],
            }
        )
    if shared:
        out.update(
            {
                p + "mlp.shared_experts.gate_proj.weight": [shared, h],
                p + "mlp.shared_experts.up_proj.weight": [shared, h],
                p + "mlp.shared_experts.down_proj.weight": [h, shared],
            }
        )
    return out


def mtp_prefixes(hf: dict) -> Tuple[str, ...]:
    """Name prefixes of DeepSeek-V3's multi-token-prediction layers (``num_nextn_predict_layers`` of them, after
    the decoder layers): checkpoints carry them; transformers and rlmega's learners do not build them."""
    n = (
        int(hf.get("num_nextn_predict_layers") or 0)
        if architecture(hf) == "DeepseekV3ForCausalLM"
        else 0
    )
    return tuple(f"model.layers.{hf['num_hidden_layers'] + j}." for j in range(n))


def expected_shapes(hf: dict) -> Tuple[Dict[str, List[int]], Dict[str, List[int]]]:
    """(required, optional) HF tensor names -> shapes that config.json ``hf`` implies for a Llama, Qwen2,
    Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 or Gemma 3 model; optional: lm_head.weight of a tied model (some
    checkpoints store the copy). Qwen3-MoE on disk: per-expert mlp.experts.E.{gate,up,down}_proj
    (moe_intermediate_size) and the router mlp.gate [num_experts, hidden]; Mixtral:
    block_sparse_moe.experts.E.{w1,w3,w2} (intermediate_size: every layer is MoE) and block_sparse_moe.gate."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv, hd = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or h // heads
    vocab, inter = hf["vocab_size"], hf["intermediate_size"]
    req = {"model.embed_tokens.weight": [vocab, h], "model.norm.weight": [h]}
    head = {"lm_head.weight": [vocab, h]}
    opt = head if hf.get("tie_word_embeddings") else {}
    req.update({} if opt else head)
    arch = architecture(hf)
    qwen3 = arch in QWEN3
    bias = arch == "Qwen2ForCausalLM" or (qwen3 and bool(hf.get("attention_bias")))
    experts = num_experts(hf) if arch in MOE_HF_NAMES else 0
    sparse, moe_inter = (
        (_sparse_layers(hf), hf.get("moe_intermediate_size")) if experts else (set(), None)
    )
    if arch == "MixtralForCausalLM":
        sparse, moe_inter = set(range(hf["num_hidden_layers"])), inter
    # read iff experts
    block, (gate, up, down) = MOE_HF_NAMES.get(arch, MOE_HF_NAMES["Qwen3MoeForCausalLM"])
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if arch == "DeepseekV3ForCausalLM":
            req.update(_deepseek_layer_shapes(hf, i))
            continue
        req.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * hd, h],
                p + "self_attn.k_proj.weight": [kv * hd, h],
                p + "self_attn.v_proj.weight": [kv * hd, h],
                p + "self_attn.o_proj.weight": [h, heads * hd],
            }
        )
        if i in sparse:
            req[f"{p}{block}.gate.weight"] = [experts, h]
            for e in range(experts):
                q = f"{p}{block}.experts.{e}."
                req.update(
                    {
                        f"{q}{gate}.weight": [moe_inter, h],
                        f"{q}{up}.weight": [moe_inter, h],
                        f"{q}{down}.weight": [h, moe_inter],
                    }
                )
        else:
            req.update(
                {
                    p + "mlp.gate_proj.weight": [inter, h],
                    p + "mlp.up_proj.weight": [inter, h],
                    p + "mlp.down_proj.weight": [h, inter],
                }
            )
        if qwen3 or arch == "Gemma3ForCausalLM":
            req.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
        # norms before and after the MLP (post_attention_layernorm: after attention)
        if arch == "Gemma3ForCausalLM":
            req.update(
                {
                    p + "pre_feedforward_layernorm.weight": [h],
                    p + "post_feedforward_layernorm.weight": [h],
                }
            )
        if bias:
            req.update(
                {
                    p + "self_attn.q_proj.bias": [heads * hd],
                    p + "self_attn.k_proj.bias": [kv * hd],
                    p + "self_attn.v_proj.bias": [kv * hd],
                }
            )
            if qwen3:  # Qwen3Attention gives o_proj a bias too when attention_bias is set
                req[p + "self_attn.o_proj.bias"] = [h]
    return req, opt


def _listed(names: List[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def weight_problems(path: str, hf: dict) -> List[str]:
    """Why the folder's safetensors weights cannot be the model config.json describes ([] when they can).
    Each entry is a sentence for the model.path field."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return []
    found: Dict[str, Tuple[str, List[int]]] = {}
    for file in files:
        try:
            found.update(read_safetensors_header(file))
        except (HeaderError, OSError) as e:
            return [f"{file} is not a complete safetensors file: {e}"]
    arch = architecture(hf)
    if arch is None or "intermediate_size" not in hf or "vocab_size" not in hf:
        return []  # refused (or described) elsewhere; nothing to compare against
    req, opt = expected_shapes(hf)
    names = {
        k
        for k in found
        if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(mtp_prefixes(hf) or "\0")
    }
    out = []
    missing = [k for k in req if k not in names]
    extra = sorted(names - set(req) - set(opt))
    wrong = [
        f"{k} {found[k][1]} (config.json implies {want})"
        for k, want in {**req, **opt}.items()
        if k in found and found[k][1] != want
    ]
    if missing:
        out.append(
            f"the weights lack {len(missing)} tensor(s) a {arch} with this config.json has: {_listed(missing)}"
        )
    if extra:
        out.append(
            f"the weights hold {len(extra)} tensor(s) a {arch} with this config.json does not have: "
            f"{_listed(extra)}"
        )
    if wrong:
        out.append(
            f"{len(wrong)} tensor shape(s) disagree with config.json (hidden_size, vocab_size, heads, "
            f"intermediate_size): {_listed(wrong)}"
        )
    return out


TOKENIZER_PROBE = "1+2="


def tokenizer_problems(path: str, hf: dict) -> List[str]:
    """Why the folder has no usable tokenizer ([] when it has one). Entries are sentences for model.path."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
        slow = os.path.exists(os.path.join(path, "tokenizer.model")) or all(
            os.path.exists(os.path.join(path, f)) for f in ("vocab.json", "merges.txt")
        )
        return (
            []
            if slow
            else [
                f"{path!r} has no tokenizer.json (nor tokenizer.model, nor vocab.json with "
                "merges.txt): tokenizer_config.json alone holds no vocabulary"
            ]
        )
    # the Rust library transformers' fast tokenizers wrap: quick to import
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tj)
        ids = tok.encode(TOKENIZER_PROBE, add_special_tokens=False).ids
    except Exception as e:  # tokenizers raises its own Exception subclass for every parse error
        return [f"{tj} cannot be loaded: {str(e)[:200]}"]
    out = []
    if not ids:
        out.append(f"{tj} encodes {TOKENIZER_PROBE!r} to no tokens at all")
    size, vocab = tok.get_vocab_size(with_added_tokens=True), hf.get("vocab_size")
    if isinstance(vocab, int) and size > vocab:
        out.append(
            f"{tj} has {size} tokens but config.json's vocab_size is {vocab}: the larger ids have no "
            "embedding row"
        )
    return out


def model_identity(path: str, sample_bytes: int = 1 << 20) -> str:
    """A fingerprint of the model in folder ``path`` (sha256, hex): config.json, and each weight file's name,
    size and first and last ``sample_bytes`` (a safetensors file's header, with every tensor's name, shape
    and offsets, and the first and last weights). Reading every weight of a large teacher would take minutes;
    these bytes tell apart a different model, or another fine-tune of the same one, in milliseconds."""
    import hashlib

    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for file in sorted(p for g in WEIGHT_GLOBS for p in glob.glob(os.path.join(path, g))):
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(sample_bytes))
            f.seek(max(size - sample_bytes, 0))
            h.update(f.read(sample_bytes))
    return h.hexdigest()
