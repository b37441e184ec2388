"""The FSDP learner's model families (rlmega/config/families.py): each tiny model of a 2026 family gives, packed
into one row through rlmega's attention (and its per-sequence linear-attention layers), each sequence's
logits and gradients as transformers' eager attention gives them for that sequence alone; the packing check
refuses a model whose state crosses sequences; the table, the tiny-model maker and docs/backends.md agree.
"""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlmega.config import families
from rlmega.fsdp import family_check, packed_attention, recurrent_layers
from rlmega.fsdp.model_manager import FSDPModelManager
from rlmega.demo.tiny_model import ARCHITECTURES, make_tiny_model

NEW = ("gemma3", "olmo3", "gpt_oss", "deepseek_v3", "qwen3_next")
LENS = (23, 17, 5)  # longer and shorter than the sliding window (8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {
        a: make_tiny_model(d / a, arch=a, num_layers=4, seed=0)
        for a in (*NEW, "mixtral", "qwen3_moe")
    }


def _ours(path):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=packed_attention.NAME
    )
    recurrent_layers.restart_at_sequences(model)
    return model


@pytest.mark.parametrize("arch", NEW)
def test_a_packed_row_gives_each_sequence_alone(tiny, arch):
    """Logits and gradients through packing (with activation checkpointing's recompute) against transformers'
    eager attention on each sequence alone."""
    ref = AutoModelForCausalLM.from_pretrained(
        tiny[arch], dtype=torch.float32, attn_implementation="eager"
    ).train()
    ours = _ours(tiny[arch]).train()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, ref.config.vocab_size, (1, n), generator=g) for n in LENS]
    got = ours(
        input_ids=torch.cat(seqs, 1),
        position_ids=torch.cat([torch.arange(n) for n in LENS])[None],
        use_cache=False,
    ).logits
    want = torch.cat([ref(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    err = (got - want).abs().max().item()
    print("PACKED", arch, f"{err:.2g}")
    # measured <= 8.4e-7 (float32 kernels); a leak across sequences is 7.5e-2
    assert err < 5e-6, err
    got.square().sum().backward()
    want.square().sum().backward()
    gerr = max(
        (a.grad - b.grad).abs().max().item() / (b.grad.abs().max().item() + 1e-12)
        for a, b in zip(ours.parameters(), ref.parameters())
        if b.grad is not None
    )
    # relative to each parameter's largest gradient; measured <= 7e-5 (Qwen3-Next)
    assert gerr < 1e-3, gerr
    assert family_check.check_packing(ours, ours.config.vocab_size, "float32") < 1e-5


@pytest.mark.parametrize("arch", (*NEW, "mixtral", "qwen3_moe"))
def test_the_weight_sync_sends_the_checkpoint_layout(tiny, arch):
    """What the FSDP learner streams to vLLM (FSDPModelManager._checkpoint_layout of its parameters) is the saved
    checkpoint, names and values, though transformers 5 holds some families' experts fused under other names."""
    model = AutoModelForCausalLM.from_pretrained(tiny[arch], dtype=torch.float32)
    manager = SimpleNamespace(model=model, lora_rank=0)
    got = dict(
        FSDPModelManager._checkpoint_layout(manager, FSDPModelManager.iter_model_tensors(manager))
    )
    disk = load_file(Path(tiny[arch]) / "model.safetensors")
    # DeepSeek-V3's router bias, a buffer, included: vLLM loads it with the router
    assert set(got) == set(disk)
    assert all(torch.equal(got[k], disk[k]) for k in got)


def test_linear_attention_leaks_across_sequences_without_the_restart_and_the_check_refuses_it(tiny):
    """Without rlmega's per-sequence restart transformers' Qwen3-Next carries the recurrent state from one
    packed sequence into the next: the check a model outside the table must pass refuses it, naming it."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny["qwen3_next"], dtype=torch.float32, attn_implementation=packed_attention.NAME
    )
    with pytest.raises(
        family_check.PackingError, match="Qwen3NextForCausalLM: a packed row of two sequences"
    ):
        family_check.check_packing(model, model.config.vocab_size, "float32")


def test_sink_attention_equals_transformers_eager_gpt_oss_attention():
    """The pure function against transformers' own GPT-OSS eager attention, a causal mask, GQA and a window."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 11, 8, generator=g),
        torch.randn(1, 2, 11, 8, generator=g),
        torch.randn(1, 2, 11, 8, generator=g),
    )
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = (
        torch.randn(4, generator=g),
        2,
        False,
    )
    for window in (None, 4):
        mask = packed_attention._window_mask(11, window, q.device)
        mask = torch.ones(11, 11, dtype=torch.bool).tril()[None, None] if mask is None else mask
        want, _ = eager_attention_forward(
            module, q, k, v, torch.zeros(mask.shape).masked_fill(~mask, float("-inf")), scaling=0.35
        )
        got = packed_attention.sink_attention(
            q, k, v, module.sinks, 0.35, None if window is None else mask
        )
        assert (got - want).abs().max().item() < 1e-6


def test_the_table_the_tiny_models_and_the_docs_agree():
    fsdp = {f.model_type for f in families.FAMILIES if "fsdp" in f.learners}
    made = {ARCHITECTURES[a][0].model_type for a in ARCHITECTURES}
    assert fsdp <= made, fsdp - made  # every family in the table has a tiny model to test it on
    from rlmega.config.hf_support import SUPPORTED_ARCHITECTURES

    assert SUPPORTED_ARCHITECTURES == families.megatron_architectures()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    assert families.markdown_table() in docs, (
        "regenerate docs/backends.md's table: python -m rlmega.config.families"
    )


@pytest.mark.parametrize(
    "hf, kw, field, words",
    [
        (
            {"architectures": ["GraniteForCausalLM"]},
            {},
            "model.path",
            "'GraniteForCausalLM' is not a family",
        ),
        (
            {"architectures": ["Qwen3NextForCausalLM"]},
            {"dtype": "float32"},
            "model.dtype",
            "bfloat16 only",
        ),
        (
            {"architectures": ["Qwen3NextForCausalLM"]},
            {"dtype": "bfloat16", "ulysses_size": 2},
            "actor.ulysses_size",
            "linear-attention layers",
        ),
        (
            {"architectures": ["GptOssForCausalLM"]},
            {"rollout_device": "cuda"},
            "model.path",
            "leaves the experts",
        ),
    ],
)
def test_refusals_name_the_field(hf, kw, field, words):
    args = {"dtype": "float32", "rollout_device": "cpu", "ulysses_size": 1, **kw}
    got = families.fsdp_reason(hf, **args)
    assert got is not None and got[0] == field and words in got[1], got


def test_ulysses_is_refused_with_attention_sinks(monkeypatch):
    """(GPT-OSS is refused on every device for now; the sinks rule is for when that goes.)"""
    gpt_oss = families.family({"model_type": "gpt_oss"})
    monkeypatch.setitem(
        families._BY_ARCH, gpt_oss.architecture, dataclasses.replace(gpt_oss, refused="")
    )
    got = families.fsdp_reason(
        {"architectures": [gpt_oss.architecture]}, "float32", "cuda", ulysses_size=2
    )
    assert got[0] == "actor.ulysses_size" and "attention sinks" in got[1], got


def test_what_the_table_lets_through():
    assert (
        families.fsdp_reason(
            {"architectures": ["GraniteForCausalLM"]}, "float32", "cpu", allow_untested=True
        )
        is None
    )
    # vLLM on GPUs: any dtype
    assert families.fsdp_reason({"model_type": "qwen3_next"}, "float32", "cuda") is None
    assert families.fsdp_reason({"model_type": "gemma3_text"}, "float32", "cpu") is None


def test_gemma3_on_megatron_reads_both_config_forms_and_refuses_what_it_would_compute_otherwise(
    tiny,
):
    """rlmega/config/gemma3_layout.py: transformers 5's config.json and Google's transformers-4 form give one layout;
    the preflight's safetensors check expects exactly the tiny model's tensors; each setting the Megatron mapping
    does not compute is refused, naming it."""
    from rlmega.config.gemma3_layout import gemma3_layout
    from rlmega.config.hf_support import unsupported_reason
    from rlmega.config.model_files import expected_shapes

    path = tiny["gemma3"]
    hf = __import__("json").loads((Path(path) / "config.json").read_text())
    assert unsupported_reason(hf) is None
    layout = gemma3_layout(hf)
    assert layout.sliding == (True, False, True, False) and layout.window == 8
    assert (layout.global_theta, layout.sliding_theta, layout.global_linear_factor) == (
        1e6,
        1e4,
        None,
    )
    v4 = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    v4.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)
    assert gemma3_layout(v4) == layout and unsupported_reason(v4) is None
    scaled = dict(v4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert gemma3_layout(scaled).global_linear_factor == 8.0
    required, optional = expected_shapes(hf)
    on_disk = {k: list(v.shape) for k, v in load_file(Path(path) / "model.safetensors").items()}
    assert set(required) <= set(on_disk) <= set(required) | set(optional)
    assert all(on_disk[k] == want for k, want in {**required, **optional}.items() if k in on_disk)
    for change, words in [
        ({"final_logit_softcapping": 30.0}, "soft-capping"),
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "gelu"}, "gelu_pytorch_tanh"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE types"),
    ]:
        assert words in unsupported_reason(dict(v4, **change)), change
