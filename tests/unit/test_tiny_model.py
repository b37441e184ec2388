"""The tiny model maker: folders that transformers loads, deterministic weights, a sane tokenizer."""

import runpy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
)

from rlmega.demo.tiny_model import NATURAL_VOCAB_SIZE, make_tiny_model

SMALL = dict(num_layers=2)  # keeps each model well under a second to build


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", **SMALL)


def test_transformers_loads_and_runs(qwen2_dir):
    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.dtype == torch.float32
    assert model.config.head_dim == 64  # vLLM's CPU attention rejects 16
    assert model.config.vocab_size == len(tok) == NATURAL_VOCAB_SIZE

    batch = tok(["12+34=46", "1+1=2 ok"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits  # (B, T, V)
    assert logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_differs(tmp_path, qwen2_dir):
    again = make_tiny_model(tmp_path / "again", seed=0, **SMALL)
    other = make_tiny_model(tmp_path / "other", seed=1, **SMALL)
    weights = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(again) == weights(qwen2_dir)
    assert weights(other) != weights(qwen2_dir)


def test_caller_rng_state_untouched(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    make_tiny_model(tmp_path / "m", seed=7, **SMALL)
    assert torch.equal(torch.get_rng_state(), before)


def test_llama_variant(tmp_path):
    path = make_tiny_model(tmp_path / "llama", arch="llama", **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.head_dim == 64


def test_qwen3_variant_has_qk_norms(tmp_path):
    from rlmega.config.hf_support import unsupported_reason

    path = make_tiny_model(tmp_path / "qwen3", arch="qwen3", **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 64
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert (
        "model.layers.0.self_attn.q_norm.weight" in names
        and "model.layers.0.self_attn.q_proj.bias" not in names
    )
    assert unsupported_reason(AutoConfig.from_pretrained(path).to_dict()) is None


def test_qwen3_moe_variant_per_expert_weights(tmp_path):
    from rlmega.config.hf_support import num_experts, unsupported_reason

    path = make_tiny_model(
        tmp_path / "moe",
        arch="qwen3_moe",
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        hidden_size=64,
        **SMALL,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, NATURAL_VOCAB_SIZE)
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 64)  # the router
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (16, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 16)
    hf = AutoConfig.from_pretrained(path).to_dict()
    assert num_experts(hf) == 4 and hf["num_experts_per_tok"] == 2 and hf["norm_topk_prob"] is True
    assert unsupported_reason(hf) is None
    with pytest.raises(ValueError, match="top_k=5"):
        make_tiny_model(tmp_path / "bad", arch="qwen3_moe", num_experts=4, top_k=5)


def test_mixtral_variant_per_expert_weights_match_the_preflight_and_the_mapping(tmp_path):
    """Mixtral's on-disk names (block_sparse_moe.experts.E.w1/w3/w2, block_sparse_moe.gate) are exactly the
    ones the preflight's safetensors check expects and the Megatron mapping reads."""
    from rlmega.config.hf_support import num_experts, unsupported_reason
    from rlmega.config.model_files import expected_shapes

    path = make_tiny_model(
        tmp_path / "mix",
        arch="mixtral",
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        hidden_size=64,
        **SMALL,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, NATURAL_VOCAB_SIZE)
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == [4, 64]  # the router
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w1.weight"] == [16, 64]  # gate
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == [64, 16]  # down
    hf = AutoConfig.from_pretrained(path).to_dict()
    assert num_experts(hf) == 4 and hf["num_experts_per_tok"] == 2 and hf["sliding_window"] is None
    assert unsupported_reason(hf) is None
    required, optional = expected_shapes(hf)
    assert required == shapes and optional == {}
    with pytest.raises(ValueError, match="top_k=5"):
        make_tiny_model(tmp_path / "bad", arch="mixtral", num_experts=4, top_k=5)


@pytest.mark.parametrize("tied", [False, True])  # Phi-3-mini is untied, Phi-4-mini tied
def test_phi3_variant_fused_weights_tied_and_untied(tmp_path, tied):
    """Phi3: the architecture only actor.backend=fsdp trains (our Megatron mapping refuses it)."""
    from rlmega.config.hf_support import unsupported_reason

    path = make_tiny_model(tmp_path / "phi3", arch="phi3", tie_word_embeddings=tied, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, Phi3ForCausalLM) and model.dtype == torch.float32
    assert model.config.head_dim == 64 and model.config.tie_word_embeddings == tied
    assert unsupported_reason(model.config.to_dict())  # Megatron refuses it
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    h, kv = 128, 1  # SMALL keeps hidden 128, 2 heads, 1 KV head of 64
    # [q; k; v] rows
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [h + 2 * kv * 64, h]
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == [2 * 2 * h, h]  # [gate; up] rows
    assert ("lm_head.weight" in shapes) != tied  # a tied head is stored once, as the embedding
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    tok = AutoTokenizer.from_pretrained(path)
    text = "what is (3*4)-2?  it's \"10\".\nok"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode("12+34=46")) == 8
    with torch.no_grad():
        assert torch.isfinite(model(**tok(["12+34=46"], return_tensors="pt")).logits).all()


def test_tied_embeddings(tmp_path):
    path = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # stored once, as the embedding


def test_odd_vocab_size_pads_tokenizer(tmp_path):
    vocab_size = NATURAL_VOCAB_SIZE + 6
    assert vocab_size % 2 == 1
    path = make_tiny_model(tmp_path / "odd", vocab_size=vocab_size, **SMALL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tok) == model.config.vocab_size == vocab_size
    assert tok.convert_ids_to_tokens(vocab_size - 1) == "<extra_5>"
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, vocab_size)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(vocab_size=NATURAL_VOCAB_SIZE - 1), "vocab_size"), (dict(arch="gpt2"), "arch")],
)
def test_bad_arguments_name_the_parameter(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name) as err:
        make_tiny_model(tmp_path / "bad", **kwargs)
    if name == "arch":
        assert all(a in str(err.value) for a in ("llama", "qwen2", "phi3"))
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trip(tmp_path, qwen2_dir, arch):
    # transformers 5 rebuilds qwen2 tokenizers as Qwen2Tokenizer; llama keeps tokenizer.json as is.
    path = (
        qwen2_dir if arch == "qwen2" else make_tiny_model(tmp_path / "llama", arch="llama", **SMALL)
    )
    tok = AutoTokenizer.from_pretrained(path)
    for text in ["12+34=46", "what is (3*4)-2?  it's \"10\".\nok", "ab</s>"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert len(tok.encode("12+34=46")) == 8  # one token per character
    assert tok.encode("</s>") == [tok.eos_token_id]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)


def test_chat_template(qwen2_dir):
    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: add\nuser: 1+1?\nassistant: "
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids) == text


def test_existing_folder_needs_overwrite(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=0, **SMALL)
    with pytest.raises(FileExistsError):
        make_tiny_model(path, seed=1, **SMALL)
    make_tiny_model(path, seed=1, overwrite=True, **SMALL)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folders left over


def test_cli(tmp_path, capsys):
    cli = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "make_tiny_model.py"))
    cli["main"](
        [str(tmp_path / "cli"), "--arch", "llama", "--num-layers", "1", "--vocab-size", "61"]
    )
    out = capsys.readouterr().out
    assert str(tmp_path / "cli") in out and "parameters" in out
    config = AutoConfig.from_pretrained(tmp_path / "cli")
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 1, 61)
    cli["main"](
        [str(tmp_path / "phi3"), "--arch", "phi3", "--num-layers", "1", "--tie-word-embeddings"]
    )
    config = AutoConfig.from_pretrained(tmp_path / "phi3")
    assert (config.model_type, config.architectures, config.tie_word_embeddings) == (
        "phi3",
        ["Phi3ForCausalLM"],
        True,
    )
