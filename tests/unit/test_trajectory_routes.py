"""MoE routes (R3) from engine samples to the trainer's batch: single- and multi-turn trajectories
(tool tokens -1), batch_from_samples / batch_from_groups, and the async buffer's checkpoint form."""

from __future__ import annotations

import io
import types

import numpy as np
import torch

from rlmega.agents.buffer import ProducedBatch
from rlmega.agents.loop import GroupRequest
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup, batch_from_groups
from rlmega.data.samples import batch_from_samples

LAYERS, TOPK = 2, 2


def _rows(n: int, start: int = 0) -> np.ndarray:
    """Engine rows for n positions, the last one unrecorded (-1), as Sample.routed_experts."""
    r = (np.arange(start, start + n * LAYERS * TOPK) % 8).astype(np.int16).reshape(n, LAYERS, TOPK)
    r[-1] = -1
    return r


def test_single_and_tool_turns_carry_routes_with_tool_tokens_unrouted():
    prompt = [1, 5, 7]
    t = Trajectory(prompt_ids=prompt)
    t.append([9, 10], [-0.1, -0.2], 0, model=True, routes=_rows(5))
    t.append([40, 41, 42], None, -1, model=False)  # a tool result: no engine route
    turn2 = _rows(10, start=3)  # the next turn re-read all 8 earlier tokens as its prompt
    t.append([11, 2], [-0.3, -0.4], 1, model=True, routes=turn2)
    r = t.routed_experts
    assert r.shape == (10, LAYERS, TOPK) and r.dtype == torch.int16
    # model and prompt tokens: the latest computation (turn 2's prefill); tool tokens -1; last token -1
    assert torch.equal(r[:5], torch.from_numpy(turn2[:5]))
    assert (r[5:8] == -1).all()
    assert torch.equal(r[8], torch.from_numpy(turn2[8])) and (r[9] == -1).all()

    batch = batch_from_groups(
        [TrajectoryGroup(task="t", prompt_index=0, label=None, trajectories=[t])]
    )
    assert len(batch.routed_experts) == 1 and torch.equal(batch.routed_experts[0], r)


def test_batch_from_samples_and_groups_without_routes_have_none():
    s = types.SimpleNamespace(
        prompt_index=0, prompt_ids=[1, 2], response_ids=[3], logprobs=[-1.0], routed_experts=None
    )
    assert batch_from_samples([s]).routed_experts is None
    t = Trajectory(prompt_ids=[1, 2])
    t.append([3], [-1.0], 0, model=True)
    assert t.routed_experts is None
    assert (
        batch_from_groups(
            [TrajectoryGroup(task="t", prompt_index=0, label=None, trajectories=[t])]
        ).routed_experts
        is None
    )
    s.routed_experts = _rows(3)
    b = batch_from_samples([s])
    assert torch.equal(b.routed_experts[0], torch.from_numpy(_rows(3)))


def test_buffer_checkpoint_keeps_routes():
    t = Trajectory(prompt_ids=[1, 5])
    t.append([9, 10], [-0.1, -0.2], 0, model=True, routes=_rows(4))
    batch = ProducedBatch(
        index=3,
        groups=[TrajectoryGroup(task="t", prompt_index=0, label="x", trajectories=[t])],
        requests=[("t", GroupRequest(prompt_index=0, prompt_ids=[1, 5], label="x", seed=0))],
    )
    buf = io.BytesIO()
    torch.save(batch.to_state(), buf)
    buf.seek(0)
    back = ProducedBatch.from_state(torch.load(buf, weights_only=True))
    assert torch.equal(back.groups[0].trajectories[0].routed_experts, t.routed_experts)
