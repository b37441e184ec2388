"""rlmega/megatron/packed_attention.py against megatron-core's own local attention, on one gloo rank.

PackedSDPAttention on packed rows (several sequences of a row, padding tails, a row of padding, GQA)
gives megatron-core's ``DotProductAttention`` under the dense block-causal mask its outputs and its
gradients at every real token, also with a sliding window (Gemma 3's layers, rlmega/algorithms/sliding_window.py);
``rotate`` is megatron-core's ``apply_rotary_pos_emb`` without the cats.
The model-level contracts (transformers parity in every layout, packed = unpacked, layout invariance,
engine parity) are in test_hf_parity.py, test_actor.py and the e2e tests.
"""

import dataclasses

import torch

from rlmega.testing.multiproc import run_on_ranks

# row_cu of 3 rows of 24: tails 2 and 8, then all padding
ROWS = [[0, 5, 14, 15, 22], [0, 9, 16], [0]]
S, HEADS, GROUPS, DIM = 24, 4, 2, 16
WINDOW = 4


def _body():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from rlmega.data.packing import block_causal_mask
    from rlmega.megatron.packed_attention import (
        PackedSDPAttention,
        RowPacking,
        rotate,
        row_segments,
    )
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1, None, seed=3)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
    )
    kw = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    ours, theirs = PackedSDPAttention(**kw), DotProductAttention(**kw)
    B = len(ROWS)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, DIM, generator=g)
    k, v = (torch.randn(S, B, GROUPS, DIM, generator=g) for _ in range(2))
    # (B, 1, S, S)
    mask = torch.cat([block_causal_mask(torch.tensor(cu, dtype=torch.int32), S) for cu in ROWS])
    real = torch.zeros(S, B, 1, dtype=torch.bool)
    for r, cu in enumerate(ROWS):
        real[: cu[-1], r] = True
    segments = row_segments(ROWS, B, S)
    assert segments == [5, 9, 1, 7, 2, 9, 7, 8, 24]

    def run(module, packing, mask_):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*qkv, mask_, packed_seq_params=packing)  # (S, B, HEADS * DIM)
        (out * real).square().sum().backward()  # real tokens only: padding outputs are never read
        return out.detach() * real, [t.grad for t in qkv]

    got, got_grads = run(
        ours,
        RowPacking(qkv_format="sbhd", max_seqlen_q=S, max_seqlen_kv=S, segments=segments),
        None,
    )
    want, want_grads = run(theirs, None, mask)
    errors = {"out": (got - want).abs().max().item()}
    for name, a, b in zip("qkv", got_grads, want_grads):
        # key/value gradients at padding positions differ by design (padding keys are seen by the
        # padding tail's own queries only, whose outputs carry no gradient): compare real positions
        errors["d" + name] = ((a - b) * real.unsqueeze(-1)).abs().max().item()
    # no RowPacking: plain SDPA under the same dense mask
    plain, _ = run(ours, None, mask)
    errors["dense_mask"] = (plain - want).abs().max().item()

    # a sliding window of WINDOW (megatron-core's window_size (WINDOW - 1, 0); segments of up to 9 tokens, so
    # windowed blocks) against megatron's attention under the dense block-causal mask that also hides keys WINDOW or
    # more tokens back
    windowed = PackedSDPAttention(
        **{**kw, "config": dataclasses.replace(config, window_size=(WINDOW - 1, 0))}
    )
    assert windowed.window == WINDOW
    pos = torch.arange(S)
    far = (pos[:, None] - pos[None, :]) >= WINDOW  # (S, S), True = too far back
    got, got_grads = run(
        windowed,
        RowPacking(qkv_format="sbhd", max_seqlen_q=S, max_seqlen_kv=S, segments=segments),
        None,
    )
    want, want_grads = run(theirs, None, mask | far)
    errors["window_out"] = (got - want).abs().max().item()
    for name, a, b in zip("qkv", got_grads, want_grads):
        errors["window_d" + name] = ((a - b) * real.unsqueeze(-1)).abs().max().item()
    errors["window_changes_it"] = (
        -(
            got
            - run(
                ours,
                RowPacking(qkv_format="sbhd", max_seqlen_q=S, max_seqlen_kv=S, segments=segments),
                None,
            )[0]
        )
        .abs()
        .max()
        .item()
    )

    # RoPE: rotate(x, cos, sin) == megatron's apply_rotary_pos_emb(x, [freqs, freqs])
    angles = torch.rand(S, B, 1, DIM // 2, generator=g) * 50.0
    freqs = torch.cat((angles, angles), dim=-1)
    errors["rope"] = (
        (
            rotate(q, torch.cos(freqs), torch.sin(angles))
            - apply_rotary_pos_emb(q, freqs, config=config)
        )
        .abs()
        .max()
        .item()
    )
    teardown_megatron()
    return errors


def test_packed_sdpa_equals_megatron_dot_product_attention_under_the_block_mask():
    errors = run_on_ranks(_body, 1, timeout_s=120)[0]
    print(errors)
    assert errors.pop("window_changes_it") < -0.1, (
        "the window must change the outputs of these segments"
    )
    # measured (float32, 2-core CPU): out 3.6e-7, dq 2.6e-6, dk 3.3e-6, dv 3.8e-6 (gradients of a
    # squared sum, magnitudes ~10), dense mask 3.6e-7, rope 2.4e-7; with the window of 4 the same (dv 1.9e-6)
    assert max(errors.values()) < 1e-5, errors
