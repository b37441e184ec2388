"""Micro-batch planning, packing and the block-causal mask (checked against per-sequence attention)."""

import random

import pytest
import torch
import torch.nn.functional as F

from rlmega.data.packing import (
    block_causal_mask,
    pack,
    padding_efficiency,
    plan_micro_batches,
    unpack,
)


def random_lengths(n, lo=1, hi=100, seed=0):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def check_plan(lengths, plan, max_tokens, dp_size, multiple_of):
    assert len(plan) == dp_size
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    for rank in plan:
        assert len(rank) % multiple_of == 0
        for mb in rank:
            assert mb and mb == sorted(mb)
            assert sum(lengths[i] for i in mb) <= max_tokens
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)  # LPT's guarantee


def test_plan_hand_computed():
    # Longest first to the lightest rank: 8->r0, 7->r1, 5->r1, 3->r0, 2->r0, 1->r1 (13 tokens each).
    # FFD (10 tokens): r0 [8, 3, 2] -> {8, 2}, {3}; r1 [7, 5, 1] -> {7, 1}, {5}.
    plan = plan_micro_batches([5, 3, 8, 2, 7, 1], max_tokens=10, dp_size=2)
    assert plan == [[[2, 3], [1]], [[4, 5], [0]]]
    assert plan_micro_batches([4, 4, 4], max_tokens=100) == [[[0, 1, 2]]]
    assert plan_micro_batches([4, 4, 4], max_tokens=4) == [[[0], [1], [2]]]
    # Ties go to the lowest rank and the lowest index.
    assert plan_micro_batches([1, 1, 1, 1], max_tokens=10, dp_size=3) == [[[0, 3]], [[1]], [[2]]]


@pytest.mark.parametrize(
    "n,max_tokens,dp_size,multiple_of",
    [
        (1, 100, 1, 1),
        (37, 100, 1, 1),
        (64, 256, 4, 1),
        (50, 150, 2, 2),
        (100, 300, 3, 4),
        (9, 1000, 2, 4),
    ],
)
def test_plan_invariants(n, max_tokens, dp_size, multiple_of):
    lengths = random_lengths(n, seed=n)
    plan = plan_micro_batches(lengths, max_tokens, dp_size, multiple_of)
    check_plan(lengths, plan, max_tokens, dp_size, multiple_of)
    # deterministic
    assert plan == plan_micro_batches(list(lengths), max_tokens, dp_size, multiple_of)


def test_plan_ffd_is_tight():
    lengths = random_lengths(200, seed=1)
    plan = plan_micro_batches(lengths, max_tokens=512)
    lower_bound = -(-sum(lengths) // 512)
    assert len(plan[0]) <= lower_bound + 1
    assert padding_efficiency(lengths, plan, row_multiple=1) == 1.0


def test_plan_multiple_of_splits_most_populated_bin():
    # One bin of 4 samples; multiple_of=2 splits it into token-balanced halves {5, 1}, {3, 2}.
    plan = plan_micro_batches([5, 3, 2, 1], max_tokens=100, multiple_of=2)
    assert plan == [[[0, 3], [1, 2]]]
    plan = plan_micro_batches([5, 3, 2, 1], max_tokens=100, multiple_of=4)
    assert plan == [[[0], [3], [1], [2]]]  # [0,3] splits first (tie: first bin)


def test_plan_errors():
    with pytest.raises(
        ValueError, match="sample 2 has 11 tokens.*max_tokens=10.*raise the token budget"
    ):
        plan_micro_batches([3, 4, 11], max_tokens=10)
    with pytest.raises(ValueError, match="dp_size=4 ranks but only 3 samples"):
        plan_micro_batches([3, 4, 5], max_tokens=10, dp_size=4)
    with pytest.raises(ValueError, match="DP rank 0 has 3 samples.*needs 4 micro-batches.*fix"):
        plan_micro_batches([3, 4, 5], max_tokens=10, multiple_of=4)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        plan_micro_batches([3, 0], max_tokens=10)
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_micro_batches([3], max_tokens=0)


def test_padding_efficiency_hand_computed():
    lengths = [5, 3, 8, 2, 7, 1]
    plan = [[[2, 3], [1]], [[4, 5], [0]]]  # rows of 10, 3, 8, 5 tokens = 26 real
    assert padding_efficiency(lengths, plan) == 1.0
    assert padding_efficiency(lengths, plan, row_multiple=4) == pytest.approx(26 / (12 + 4 + 8 + 8))
    assert padding_efficiency(lengths, plan, row_multiple=8) == pytest.approx(26 / (16 + 8 + 8 + 8))
    assert padding_efficiency(lengths, []) == 1.0


def test_pack_hand_computed():
    row = pack([torch.tensor([5, 6]), torch.tensor([7, 8, 9])], row_multiple=3, pad_id=-7)
    assert row["tokens"].tolist() == [[5, 6, 7, 8, 9, -7]]
    assert row["tokens"].dtype == torch.int64
    assert row["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0]]
    assert row["seq_ids"].tolist() == [0, 0, 1, 1, 1, -1]
    assert row["cu_seqlens"].tolist() == [0, 2, 5] and row["cu_seqlens"].dtype == torch.int32
    assert row["num_real"] == 5 and row["max_seqlen"] == 3
    empty = pack([])
    assert empty["tokens"].shape == (1, 0) and empty["cu_seqlens"].tolist() == [0]


@pytest.mark.parametrize("row_multiple", [1, 8])
def test_pack_unpack_round_trip(row_multiple):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in [7, 1, 13, 4]]
    row = pack(seqs, row_multiple=row_multiple)
    assert row["tokens"].shape[1] % row_multiple == 0
    for shape in [(1, -1), (-1,)]:
        out = unpack(row["tokens"].reshape(shape), row["cu_seqlens"])
        assert [s.tolist() for s in out] == [s.tolist() for s in seqs]
    with pytest.raises(ValueError, match="cu_seqlens ends at 25"):
        unpack(torch.zeros(20), row["cu_seqlens"])


def test_block_causal_mask_hand_built():
    # Lengths [2, 3] + 1 padding; 1 = may NOT attend.
    expected = torch.tensor(
        [
            [0, 1, 1, 1, 1, 1],
            [0, 0, 1, 1, 1, 1],
            [1, 1, 0, 1, 1, 1],
            [1, 1, 0, 0, 1, 1],
            [1, 1, 0, 0, 0, 1],
            [1, 1, 1, 1, 1, 0],  # padding sees only itself
        ],
        dtype=torch.bool,
    )
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), total_len=6)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        block_causal_mask(torch.tensor([0, 4, 3]), total_len=6)


@pytest.mark.parametrize(
    "lengths,row_multiple", [([2, 3], 6), ([5, 1, 9, 3], 8), ([16], 1), ([50, 1, 77, 33], 64)]
)
def test_packed_attention_matches_per_sequence(lengths, row_multiple):
    """SDPA over a packed row with the block-causal mask == causal SDPA on each sequence alone."""
    g = torch.Generator().manual_seed(sum(lengths))
    heads, dim = 2, 8
    row = pack([torch.zeros(n, dtype=torch.int64) for n in lengths], row_multiple=row_multiple)
    total = row["tokens"].shape[1]
    q, k, v = (torch.randn(1, heads, total, dim, generator=g) for _ in range(3))  # (1, H, T, D)
    mask = block_causal_mask(row["cu_seqlens"], total)
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)  # (1, H, T, D)
    assert not packed.isnan().any()
    bounds = row["cu_seqlens"].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        alone = F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True
        )
        assert (packed[:, :, a:b] - alone).abs().max() <= 1e-6
    assert torch.equal(
        packed[:, :, bounds[-1] :], v[:, :, bounds[-1] :]
    )  # padding attends to itself


def test_short_batch_plans_placeholders_instead_of_raising():
    """Fewer samples than DP ranks, or than a rank's multiple_of micro-batches (stale drops, short
    dynamic sampling): allow_empty gives those ranks empty micro-batches after their real ones."""
    assert plan_micro_batches([3], max_tokens=10, dp_size=2, allow_empty=True) == [[[0]], [[]]]
    assert plan_micro_batches(
        [3, 4, 5], max_tokens=10, dp_size=4, multiple_of=2, allow_empty=True
    ) == [[[2], []], [[1], []], [[0], []], [[], []]]
    # a rank that can be split still is: the placeholders only fill what samples cannot
    assert plan_micro_batches([5, 3, 2, 1], max_tokens=100, multiple_of=2, allow_empty=True) == [
        [[0, 3], [1, 2]]
    ]
    for n, dp, m in [(1, 4, 1), (3, 2, 4), (5, 3, 2)]:
        lengths = random_lengths(n, seed=n)
        plan = plan_micro_batches(lengths, 200, dp, m, allow_empty=True)
        assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(n))
        assert all(len(rank) >= m and len(rank) % m == 0 for rank in plan)
    with pytest.raises(ValueError, match="no samples to plan"):
        plan_micro_batches([], max_tokens=10, allow_empty=True)
    # a placeholder computes the shortest sample's row (4 tokens, rounded up to 8): padding only
    assert padding_efficiency([4, 6], [[[0, 1]], [[]]], row_multiple=8) == pytest.approx(
        10 / (16 + 8)
    )


def test_mini_batch_count_is_whole_global_batches_and_at_least_one():
    from rlmega.data.packing import mini_batch_count

    assert [mini_batch_count(n, 8) for n in (32, 31, 16, 9, 8, 7, 1, 0)] == [4, 3, 2, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="global_batch_size"):
        mini_batch_count(8, 0)


def test_placeholder_micro_batch_has_no_loss_tokens_and_scatters_nothing():
    from rlmega.data.micro_batches import build_micro_batch, scatter_responses
    from rlmega.testing.batches import random_batch

    batch = random_batch(3, seed=1)
    for min_shape in (None, (2, 30)):
        mb = build_micro_batch(batch, [], min_shape=min_shape)
        shortest = min(range(3), key=lambda i: (batch.lengths()[i], i))
        assert (
            mb["tokens"].shape[1] >= batch.lengths()[shortest]
            and mb["tokens"][0, 0] == batch.tokens[shortest][0]
        )
        assert float(mb["loss_mask"].sum()) == 0.0 and mb["indices"] == []
        assert scatter_responses(torch.arange(mb["labels"].numel()), mb) == {}


def _routed_batch(n=7, seed=2, M=3, K=2):
    import dataclasses

    from rlmega.testing.batches import random_batch

    batch = random_batch(n, seed=seed, prompt_len=(2, 5), response_len=(1, 12))
    g = torch.Generator().manual_seed(seed)
    routes = [torch.randint(0, 8, (L, M, K), generator=g).to(torch.int16) for L in batch.lengths()]
    routes[0][-1] = -1  # a token without a recorded route
    return dataclasses.replace(batch, routed_experts=routes)


def test_routes_pack_into_rows_and_back():
    """pack_routes puts token t of a sample at its row position (the tokens' own layout); unpack_rows inverts."""
    from rlmega.data.micro_batches import build_micro_batch, unpack_rows

    batch = _routed_batch()
    mb = build_micro_batch(batch, list(range(len(batch))), min_shape=(2, 1))  # a padding row too
    B, S = mb["tokens"].shape
    assert B == 2 and len(mb["rows"][0]) == len(batch)  # one packed row, then a row of padding
    rows = mb["routed_experts"]
    assert rows.shape == (B, S, 3, 2) and rows.dtype == torch.int16
    back = unpack_rows(rows, mb)
    tokens = unpack_rows(mb["tokens"], mb)
    for i in range(len(batch)):
        assert torch.equal(back[i], batch.routed_experts[i]) and torch.equal(
            tokens[i], batch.tokens[i]
        )
    real = mb["real_tokens"].view(B, S)
    # padding: no route
    assert int(real.sum()) == batch.num_tokens() and bool((rows[~real] == -1).all())
    assert int(mb["generated"].sum()) == batch.num_response_tokens()
    assert bool(mb["real_tokens"][mb["generated"]].all())


def test_min_shape_pads_with_rows_of_padding():
    from rlmega.data.micro_batches import build_micro_batch, micro_batch_shape

    batch = _routed_batch()
    idx = [1, 4]
    assert micro_batch_shape(batch.lengths(), idx) == tuple(
        build_micro_batch(batch, idx)["tokens"].shape
    )
    assert micro_batch_shape(batch.lengths(), []) == tuple(
        build_micro_batch(batch, [])["tokens"].shape
    )
    small = build_micro_batch(batch, idx)
    B, S = small["tokens"].shape
    big = build_micro_batch(batch, idx, min_shape=(B + 2, S + 3))
    assert big["tokens"].shape == (B + 2, S + 3) and B == 1
    assert torch.equal(big["cu_seqlens"], small["cu_seqlens"]) and big["row_cu"] == small["row_cu"]
    assert float(big["loss_mask"].sum()) == float(small["loss_mask"].sum())
    assert int(big["real_tokens"].sum()) == int(small["real_tokens"].sum())
    assert bool((big["routed_experts"][B:] == -1).all())
    empty = build_micro_batch(batch, [], min_shape=(2, 30))
    assert empty["tokens"].shape == (2, 30) and not bool(empty["real_tokens"].any())
