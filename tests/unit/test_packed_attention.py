"""rlmega/fsdp/packed_attention.py: a packed row through the per-sequence causal sdpa gives each sequence's
logits as transformers' own sdpa gives them for that sequence alone (also with a sliding window shorter
than a sequence, which takes the explicit-mask branch), and the gradients through the split agree."""

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlmega.fsdp import packed_attention

LENS = [5, 9, 1, 7]


def _model(impl, **cfg):
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **cfg,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=impl
    ).eval()


def _check(**cfg):
    packed, plain = _model(packed_attention.NAME, **cfg), _model("sdpa", **cfg)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in LENS]
    tokens = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    assert packed_attention.sequence_bounds(pos) == [(0, 5), (5, 14), (14, 15), (15, 22)]
    got = packed(input_ids=tokens, position_ids=pos, use_cache=False).logits[0]
    want = torch.cat([plain(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    err = (got - want).abs().max().item()
    assert err < 1e-5, err  # measured 4.8e-7 (float32 kernel rounding)
    got.square().sum().backward()
    want.square().sum().backward()
    gerr = max(
        (a.grad - b.grad).abs().max().item() / (b.grad.abs().max().item() + 1e-12)
        for a, b in zip(packed.parameters(), plain.parameters())
    )
    assert gerr < 1e-4, gerr  # measured ~1e-6 relative


def test_packed_row_equals_each_sequence_alone():
    _check()


def test_packed_row_with_a_sliding_window_shorter_than_a_sequence():
    _check(use_sliding_window=True, sliding_window=3, max_window_layers=0)


def test_a_plain_batch_of_rows_is_causal_sdpa():
    """B > 1 rows without packing (as the MFU bench feeds it): the same as transformers' sdpa."""
    packed, plain = _model(packed_attention.NAME), _model("sdpa")
    tokens = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(2))
    err = (
        (
            packed(input_ids=tokens, use_cache=False).logits
            - plain(input_ids=tokens, use_cache=False).logits
        )
        .abs()
        .max()
    )
    assert err < 1e-5, err  # measured ~5e-7
