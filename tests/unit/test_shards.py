"""rlmega/data/shards.py and rlmega/launch/sharded.py: a batch planned once, each data-parallel rank its share."""

import torch

from rlmega.data.micro_batches import build_micro_batch
from rlmega.data.shards import Layout, plan_step
from rlmega.launch.sharded import ShardedCalls, merge
from rlmega.testing.batches import random_batch


def test_every_sample_goes_to_one_share_and_comes_back_in_place():
    batch = random_batch(11, seed=4)
    plan = plan_step(batch.lengths(), Layout(dp_size=3, max_tokens=40))
    shards = [plan.shard(batch, d) for d in range(3)]
    assert sorted(i for s in shards for i in s.samples) == list(range(11))
    # a share holds its own samples only (no placeholder here: every rank has samples)
    for s in shards:
        assert len(s.batch) == len(s.samples) and s.own == list(range(len(s.samples)))
        assert [t.tolist() for t in s.batch.tokens] == [batch.tokens[i].tolist() for i in s.samples]
    # what each rank would answer, per own sample
    answers = [[f"r{i}" for i in s.samples] for s in shards]
    assert plan.merge(answers) == [f"r{i}" for i in range(11)]


def test_a_share_builds_the_micro_batches_the_whole_batch_would():
    """Local indices, the same tensors: placeholders included (a rank with fewer samples than another's
    micro-batches, equal counts), and shapes made equal over the ranks."""
    batch = random_batch(3, seed=2)
    layout = Layout(dp_size=4, max_tokens=30, equal_counts=True, equal_shapes=True)
    plan = plan_step(batch.lengths(), layout)
    # 3 samples over 4 ranks: someone runs a placeholder
    assert any(not mb for p in plan.per_rank for mb in p)
    for d in range(4):
        part, whole = plan.shard(batch, d), plan.shard(batch, d, whole=True)
        assert (
            len(part.micro_batches)
            == len(whole.micro_batches)
            == max(len(p) for p in plan.per_rank)
        )
        for ip, iw, shape in zip(part.micro_batches, whole.micro_batches, part.shapes):
            a, b = (
                build_micro_batch(part.batch, ip, min_shape=shape),
                build_micro_batch(batch, iw, min_shape=shape),
            )
            assert [part.samples[part.own.index(i)] for i in a["indices"]] == b["indices"]
            for key in (
                "tokens",
                "position_ids",
                "labels",
                "loss_mask",
                "advantages",
                "real_tokens",
            ):
                assert torch.equal(a[key], b[key]), (d, key)
        if any(not mb for mb in part.micro_batches) and plan.placeholder not in part.samples:
            # the placeholder's tokens travel with the share
            assert len(part.batch) == len(part.samples) + 1


def test_sharded_calls_plan_once_and_merge_lists_tuples_and_dicts():
    batch = random_batch(6, seed=1)

    # the surface ShardedCalls uses: each data-parallel rank answers for its shard's samples
    class Group:
        def __init__(self):
            self.sent = []

        def submit_shards(self, method, shards, dp_of_rank, *args):
            self.sent.append([len(s.batch) for s in shards])
            answer = {
                "lp": lambda s: [i * 10 for i in s.samples],
                "both": lambda s: ([i for i in s.samples], [-i for i in s.samples]),
                "step": lambda s: {"loss": 1.5, "old_logprobs": [i for i in s.samples]},
            }[method]
            return lambda: [answer(s) for s in shards]

    group = Group()
    # TP2 x DP2
    calls = ShardedCalls(group, [(Layout(dp_size=2, max_tokens=64), r // 2) for r in range(4)])
    assert calls.dp_of_rank == [0, 0, 1, 1]
    assert calls.submit("lp", batch)() == [i * 10 for i in range(6)]
    assert calls.submit("both", batch)() == (list(range(6)), [-i for i in range(6)])
    assert calls.submit("step", batch)() == {"loss": 1.5, "old_logprobs": list(range(6))}
    assert calls.plan(batch) is calls.plan(batch)  # planned once per batch (by its lengths)
    # each sample travels to one data-parallel rank only
    assert all(sum(n) == 6 for n in group.sent)
    assert merge(calls.plan(batch), [None, None]) is None


def test_a_share_carries_only_its_own_samples_routes():
    """MoE routing replay R3 at long lengths: a data-parallel rank receives the routes of its own samples
    (and the placeholder's, where it runs one), not the whole batch's (issue 40, item 5)."""
    import dataclasses

    batch = random_batch(9, seed=2, response_len=(2, 30))
    routes = [torch.full((len(t), 3, 2), i, dtype=torch.int16) for i, t in enumerate(batch.tokens)]
    batch = dataclasses.replace(batch, routed_experts=routes)
    plan = plan_step(batch.lengths(), Layout(dp_size=4, max_tokens=40, equal_counts=True))
    whole = sum(r.numel() for r in routes)
    held = 0
    for rank in range(4):
        shard = plan.shard(batch, rank)
        # each sample's routes carry its index
        ids = {int(r[0, 0, 0]) for r in shard.batch.routed_experts}
        # + the placeholder's
        assert set(shard.samples) <= ids and len(ids - set(shard.samples)) <= 1
        held = max(held, sum(r.numel() for r in shard.batch.routed_experts))
    assert held < whole / 2
