"""The producer's pure parts: DAPO's overlong penalty and uniform groups (by hand), per-token weight
versions and staleness, the batch's checkpoint form, refill seeds, and the overlong shaping of a batch."""

import io

import pytest
import torch

from rlmega.agents.buffer import ProducedBatch, PromptQueue, ResultQueue
from rlmega.agents.loop import GroupRequest
from rlmega.agents.metrics import staleness_metrics
from rlmega.agents.produce import drop_groups, group_requests, sample_seed, stale_groups
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup, batch_from_groups, staleness
from rlmega.algorithms import dapo
from rlmega.config.schema import RLConfig
from rlmega.data.prompts import Prompt
from rlmega.step import shape_overlong


def test_overlong_penalty_is_dapo_eq_13():
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, then -1/4 per token, -1 at and past 20
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    got = dapo.overlong_penalty(lengths, max_len=20, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert dapo.overlong_penalty(lengths, 20, 4, factor=0.5).tolist() == [
        0.0,
        0.0,
        -0.125,
        -0.25,
        -0.5,
        -0.5,
    ]
    with pytest.raises(ValueError, match="overlong buffer 0"):
        dapo.overlong_penalty(lengths, 20, 0)
    assert dapo.default_buffer(20480) == 4096 and dapo.default_buffer(3) == 1


def test_uniform_groups_are_the_ones_with_one_reward():
    assert dapo.is_uniform([1.0, 1.0, 1.0]) and dapo.is_uniform([0, 0.0])
    assert not dapo.is_uniform([1.0, 0.0, 1.0])
    assert not dapo.is_uniform([0.5, 0.5000001])  # judged values, compared exactly


def _traj(versions_per_turn, reason="stop", tool=0):
    t = Trajectory(prompt_ids=[1, 2], finish_reason=reason)
    for v in versions_per_turn:
        t.append([5] * len(v), [-0.1] * len(v), v, model=True)
        if tool:
            t.append([7] * tool, None, -1, model=False)
    return t


def test_trajectories_keep_each_tokens_version_and_staleness_is_the_oldest():
    # a turn preempted by a sync (3 -> 4), a tool result, a turn
    t = _traj([[3, 3, 4], [4, 4]], tool=2)
    assert t.versions == [3, 3, 4, -1, -1, 4, 4, -1, -1]
    assert staleness(t, 5) == 2 and staleness(t, 3) == 0
    assert staleness(Trajectory(prompt_ids=[1]), 7) == 0  # nothing sampled
    with pytest.raises(ValueError, match="3 tokens but 2 weight versions"):
        t.append([1, 2, 3], [0.0] * 3, [1, 2], model=True)
    t2 = Trajectory(prompt_ids=[1])
    t2.append([1, 2], [0.0, 0.0], 6, model=True)  # one version for the whole turn
    assert t2.versions == [6, 6]


def test_staleness_metrics_histogram_and_partial_rollouts():
    g = TrajectoryGroup(
        task="t",
        prompt_index=0,
        label="1",
        trajectories=[_traj([[2, 2]]), _traj([[1, 2]]), _traj([[2]])],
    )
    failed = TrajectoryGroup(task="t", prompt_index=1, label="2", error="engine died")
    m = staleness_metrics([g, failed], step=2)
    assert m == {
        "staleness_mean": 1 / 3,
        "staleness_max": 1,
        "partial_rollouts": 1,
        "staleness/0": 2,
        "staleness/1": 1,
    }


def test_a_produced_batch_survives_a_weights_only_checkpoint():
    t = _traj([[0, 1]], tool=1)
    t.scores, t.reward, t.metadata = {"reward": 0.5}, 0.5, {"transcript": "x"}
    batch = ProducedBatch(
        index=3,
        groups=[TrajectoryGroup(task="math", prompt_index=0, label="46", trajectories=[t])],
        requests=[
            (
                "math",
                GroupRequest(
                    prompt_index=0, prompt_ids=[1, 2], label="46", seed=9, prompt_text="12+34=", n=4
                ),
            )
        ],
        stats={"time_generate": 1.5, "sampling_rounds": 1},
    )
    buf = io.BytesIO()
    torch.save({"buffer": [batch.to_state()]}, buf)
    buf.seek(0)
    back = ProducedBatch.from_state(torch.load(buf, weights_only=True)["buffer"][0])
    assert back == batch
    assert (
        batch_from_groups(back.groups).tokens[0].tolist()
        == batch_from_groups(batch.groups).tokens[0].tolist()
    )


def test_queues_count_groups():
    prompts, results = PromptQueue(), ResultQueue()
    prompts.add(0, 4)
    prompts.add(1, 2)
    prompts.done(0)
    assert prompts.size() == 5
    b = ProducedBatch(
        index=2,
        groups=[TrajectoryGroup(task="t", prompt_index=i, label="") for i in range(3)],
        requests=[],
    )
    results.put(b)
    assert results.size() == 3 and results.indices() == [2]
    with pytest.raises(RuntimeError, match="batch 2 produced twice"):
        results.put(b)
    assert results.get(1) is None and results.get(2) is b and results.size() == 0


def test_refill_rounds_continue_the_group_seeds():
    p = Prompt(index=0, token_ids=[1, 2], label="3", text="1+2=")
    base = sample_seed(10, 2)
    assert base == 10 + 2 * 1_000_003
    first = group_requests([("a", p), ("a", p)], n=4, base_seed=base)
    refill = group_requests([("a", p), ("a", p)], n=4, base_seed=base, offset=2)
    assert [r.seed for _, r in first + refill] == [base, base + 4, base + 8, base + 12]
    assert [r.prompt_index for _, r in first + refill] == [0, 1, 2, 3]
    assert group_requests([("a", p)], 1, None)[0][1].seed is None


def _batch_of(rows):
    groups = [
        TrajectoryGroup(task="default", prompt_index=0, label="", trajectories=[t for t in rows])
    ]
    for i, t in enumerate(rows):
        t.reward = float(i)
    return batch_from_groups(groups), [("default", t) for t in rows]


def test_overlong_mask_drops_cut_responses_from_the_loss_and_penalty_shapes_rewards():
    cfg = RLConfig()
    cfg.rollout.max_response_tokens = 10
    rows = [
        _traj([[0] * 10], reason="length"),
        _traj([[0] * 9]),
        _traj([[0] * 3], reason="max_tokens"),
    ]
    batch, rows = _batch_of(rows)
    cfg.algorithm.overlong = "none"
    same, m = shape_overlong(batch, rows, cfg)
    assert same is batch and m == {"overlong_fraction": 2 / 3}
    cfg.algorithm.overlong = "mask"
    masked, _ = shape_overlong(batch, rows, cfg)
    assert [float(x.sum()) for x in masked.response_mask] == [0.0, 9.0, 0.0]
    assert torch.equal(masked.rewards, batch.rewards)
    cfg.algorithm.overlong = "penalty"  # buffer: a fifth of the 10-token budget = 2 tokens
    shaped, m = shape_overlong(batch, rows, cfg)
    assert shaped.rewards.tolist() == [0.0 - 1.0, 1.0 - 0.5, 2.0]
    assert m["overlong_penalty_mean"] == pytest.approx(-0.5)
    cfg.algorithm.overlong_buffer_tokens, cfg.algorithm.overlong_penalty_factor = 5, 2.0
    shaped, _ = shape_overlong(batch, rows, cfg)
    # float32: -0.6 is 2.4e-8 off
    assert shaped.rewards.tolist() == pytest.approx([0.0 - 2.0, 1.0 - 1.6, 2.0], abs=1e-7)


def test_stale_groups_are_found_by_their_oldest_token_and_dropped_with_their_requests():
    groups = [
        TrajectoryGroup(task="t", prompt_index=i, label=str(i), trajectories=[_traj([v])])
        for i, v in enumerate([[3, 3], [1, 3], [2, 2]])
    ]
    # no tokens: not stale
    groups.append(TrajectoryGroup(task="t", prompt_index=3, label="3", error="engine died"))
    reqs = [
        ("t", GroupRequest(prompt_index=i, prompt_ids=[1], label=str(i), seed=i)) for i in range(4)
    ]
    batch = ProducedBatch(index=4, groups=groups, requests=reqs, stats={})
    assert stale_groups(batch, step=4, k=1) == [1, 2]  # 4 - 1 = 3 and 4 - 2 = 2 versions behind
    assert stale_groups(batch, step=4, k=3) == []
    drop_groups(batch, [1, 2], k=1)
    assert [g.label for g in batch.groups] == ["0", "3"] and [
        r.label for _, r in batch.requests
    ] == ["0", "3"]
    assert batch.stats["stale_dropped"] == 2
    with pytest.raises(
        RuntimeError,
        match="batch 4: every group is older than produce.max_staleness=0.*on_stale=requeue",
    ):
        drop_groups(batch, [0, 1], k=0)
