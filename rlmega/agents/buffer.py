"""The produce side's two queues, hosted by the coordinator (ActorManager) so that the dashboard charts
their sizes: ``prompts`` (groups drawn and not yet judged: waiting for or in generation) and ``results``
(finished batches waiting for the trainer, the buffer of an asynchronous run).

    batch = ProducedBatch(index=3, groups=[...], requests=[...], stats={"time_generate": 2.1})
    results.put(batch); results.get(3)          # the trainer takes batch 3 (the one its step 3 trains on)

A ProducedBatch travels into checkpoints as plain data (``to_state`` / ``from_state``: dicts, lists,
numbers, strings, bytes), which is all torch.load(weights_only=True) reads back; a trajectory's MoE
routes (int16 tensor) as {"shape", "int16": bytes}, so exact resume replays the routes it was sampled with.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from rlmega.agents.loop import GroupRequest
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup


@dataclasses.dataclass
class ProducedBatch:
    """The groups one RL step trains on: batch b for step b (0-based)."""

    index: int
    groups: list[TrajectoryGroup]
    """Group i (its prompt_index is i, the GRPO group id) came from requests[i]; failed groups included
    (error set: counted, never trained on)."""
    requests: list[tuple[str, GroupRequest]]
    """(task, request) of each group: what a stale group is generated again from (produce.on_stale)."""
    stats: dict = dataclasses.field(default_factory=dict)
    """How it was made: time_generate, sampling_rounds, prompts_drawn, groups_filtered, groups_short,
    generation_failures (see rlmega/agents/produce.py)."""

    def num_groups(self) -> int:
        return len(self.groups)

    def to_state(self) -> dict:
        return {
            "index": self.index,
            "groups": [_group_state(g) for g in self.groups],
            "requests": [[task, dataclasses.asdict(r)] for task, r in self.requests],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_state(cls, s: dict) -> "ProducedBatch":
        groups = [
            TrajectoryGroup(
                **{
                    **g,
                    "trajectories": [
                        Trajectory(**{**t, "routed_experts": _routes(t)}) for t in g["trajectories"]
                    ],
                }
            )
            for g in s["groups"]
        ]
        return cls(
            index=s["index"],
            groups=groups,
            requests=[(task, GroupRequest(**r)) for task, r in s["requests"]],
            stats=dict(s["stats"]),
        )


def _group_state(g: TrajectoryGroup) -> dict:
    state = dataclasses.asdict(dataclasses.replace(g, trajectories=[]))
    state["trajectories"] = []
    for t in g.trajectories:
        r = t.routed_experts
        state["trajectories"].append(
            {
                **dataclasses.asdict(dataclasses.replace(t, routed_experts=None)),
                "routed_experts": None
                if r is None
                else {"shape": list(r.shape), "int16": r.to(torch.int16).numpy().tobytes()},
            }
        )
    return state


def _routes(t: dict) -> torch.Tensor | None:
    r = t.get("routed_experts")  # absent in checkpoints from before MoE routing replay
    if r is None:
        return None
    return torch.frombuffer(bytearray(r["int16"]), dtype=torch.int16).reshape(r["shape"]).clone()


class PromptQueue:
    """Groups drawn and not yet judged, by batch: what the producer is working on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # batch index -> groups of it in flight

    def add(self, batch: int, groups: int) -> None:
        with self._lock:
            self._pending[batch] = self._pending.get(batch, 0) + groups

    def done(self, batch: int, groups: int = 1) -> None:
        with self._lock:
            left = self._pending.get(batch, 0) - groups
            if left > 0:
                self._pending[batch] = left
            else:
                self._pending.pop(batch, None)

    def size(self) -> int:
        with self._lock:
            return sum(self._pending.values())


class ResultQueue:
    """Finished batches by index, waiting for the trainer. ``size()`` counts groups (the dashboard's unit)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._batches: dict[int, ProducedBatch] = {}

    def put(self, batch: ProducedBatch) -> None:
        with self._lock:
            if batch.index in self._batches:
                raise RuntimeError(f"batch {batch.index} produced twice")
            self._batches[batch.index] = batch

    def get(self, index: int) -> ProducedBatch | None:
        """Remove and return batch ``index``, or None when it is not here (yet)."""
        with self._lock:
            return self._batches.pop(index, None)

    def indices(self) -> list[int]:
        with self._lock:
            return sorted(self._batches)

    def batches(self) -> list[ProducedBatch]:
        with self._lock:
            return [self._batches[i] for i in sorted(self._batches)]

    def size(self) -> int:
        with self._lock:
            return sum(b.num_groups() for b in self._batches.values())
