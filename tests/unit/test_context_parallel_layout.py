"""The context-parallel split of a packed row (rlmega/megatron/context_parallel.py): which positions each CP
rank holds, what each attends to, and how the gathered results go back in row order."""

import pytest
import torch

from rlmega.megatron.context_parallel import cp_layout, localise


@pytest.mark.parametrize(
    "segments, cp, multiple, at_least",
    [
        ([17, 3, 40, 6], 2, 1, 0),
        ([17, 3, 40, 6], 4, 2, 0),
        ([1, 2, 9], 2, 1, 0),
        ([64], 3, 4, 0),
        (
            [17, 3, 40, 6],
            2,
            2,
            41,
        ),  # as long as another DP rank's share (an expert group across DP ranks): 42 slots
    ],
)
def test_every_position_is_held_once_and_goes_back_in_row_order(segments, cp, multiple, at_least):
    layouts = [cp_layout(segments, cp, r, multiple, at_least) for r in range(cp)]
    full = sum(segments)
    local = layouts[0].local_len
    assert all(lay.local_len == local and local % multiple == 0 for lay in layouts)
    assert local == (42 if at_least else local) and local >= -(-full // cp)
    held = torch.cat([lay.local_idx[lay.local_idx >= 0] for lay in layouts])
    assert sorted(held.tolist()) == list(range(full))  # each row position on exactly one rank
    # the all-gather of every rank's slots, indexed by full_from_gathered, is the row again
    gathered = torch.cat([lay.local_idx for lay in layouts])
    for lay in layouts:
        assert torch.equal(gathered[lay.full_from_gathered], torch.arange(full))
        # the query pieces tile the local row in order; a piece attends to its segment up to its own end
        assert [q[0] for q in lay.queries] == sorted(q[0] for q in lay.queries)
        assert sum(q[1] for q in lay.queries) == local
        for start, length, k_lo, k_hi in lay.queries:
            rows = lay.local_idx[start : start + length]
            if k_lo < 0:
                assert (rows == -1).all()
            else:
                assert (
                    torch.equal(rows, torch.arange(k_hi - length, k_hi)) and k_lo <= k_hi - length
                )


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r_and_the_work_balances():
    seg = 64  # 8 chunks of 8 at CP 4
    work = []
    for r in range(4):
        lay = cp_layout([seg], 4, r)
        assert lay.local_idx.tolist() == list(range(8 * r, 8 * r + 8)) + list(
            range(8 * (7 - r), 8 * (8 - r))
        )
        work.append(sum(length * (k_hi - k_lo) for _, length, k_lo, k_hi in lay.queries))
    # causal work: chunk r's and chunk 7-r's keys add up the same
    assert max(work) == min(work), work


def test_a_sequence_shorter_than_2cp_chunks_leaves_some_chunks_empty():
    lay0, lay1 = cp_layout([3], 2, 0), cp_layout([3], 2, 1)
    # bounds 0, 0, 1, 2, 3: chunk 0 is empty; rank 0 holds chunk 3, rank 1 chunks 1 and 2
    assert lay0.local_idx.tolist() == [2, -1] and lay1.local_idx.tolist() == [0, 1]
    assert lay0.queries == [(0, 1, 0, 3), (1, 1, -1, -1)] and lay1.queries == [
        (0, 1, 0, 1),
        (1, 1, 0, 2),
    ]


def test_localise_cuts_inputs_and_keeps_the_loss_fields_whole():
    tokens = torch.arange(10)[None] + 100
    mb = {
        "tokens": tokens,
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]),
        "labels": torch.arange(10) + 200,
        "loss_mask": torch.ones(10),
        "row_cu": [[0, 6, 10]],
        "response_positions": [(2, 5), (7, 9)],
    }
    out = localise(mb, 2, 1)
    # segments 6 and 4: rank 1 holds chunks 1, 2 of each (bounds 0,1,3,4,6 and 6,7,8,9,10)
    assert out["cp"].local_idx.tolist() == [1, 2, 3, 7, 8]
    assert out["tokens"].tolist() == [[101, 102, 103, 107, 108]]
    assert out["position_ids"].tolist() == [[1, 2, 3, 1, 2]]
    assert out["labels"] is mb["labels"] and out["loss_mask"] is mb["loss_mask"]
    head = out["cp"].head_fields
    assert head["labels"].tolist() == [201, 202, 203, 207, 208]
    # row positions 2, 3, 7, 8 are scored: local slots 1-4, one run
    assert head["response_positions"] == [(1, 5)]
    with pytest.raises(ValueError, match="one packed row"):
        localise({**mb, "tokens": tokens.repeat(2, 1)}, 2, 0)


@pytest.mark.parametrize("n, m", [(5, 5), (3, 11), (1, 4)])
def test_prefix_causal_attention_equals_the_masked_softmax_with_its_gradients(n, m):
    """The CPU path (two flash calls merged by their log-sum-exps, no mask) against SDPA with the explicit
    lower-right causal mask, in float64: values and all three gradients."""
    from rlmega.megatron.context_parallel import prefix_causal_attention

    g = torch.Generator().manual_seed(n * 100 + m)
    q, k, v = (
        torch.randn(1, 3, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for length in (n, m, m)
    )
    got = prefix_causal_attention(q, k, v, 0.35)
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)  # query i sees keys up to m - n + i
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.35)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert (got - want).abs().max() < 1e-12
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(got_grads, want_grads))
