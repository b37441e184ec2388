"""What an agent loop returns: trajectories (one prompt, one response made of model and tool
tokens), grouped by prompt, and their conversion to the trainer's RolloutBatch.

A response is token in, token out: model tokens exactly as sampled (with their rollout log-probs
and the weight version they were sampled with) and tool tokens tokenized once and appended, with
``response_mask`` 0 so the loss, the log-prob parity and the KL never see them.

MoE routing replay (R3, ``algorithm.routing_replay=rollout``): a trajectory also carries the experts the
engine routed each token of prompt + response to (``routed_experts``), from its model turns' samples.
Tool-output tokens get -1 rows: the engine did not generate them (a later turn only read them as
prompt), so the trainer routes them with its own router (and counts them, ``routes_live_fraction``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.samples import routes_of

# Why a trajectory ended: the model stopped (EOS / stop token), its last turn hit max_tokens, the
# tool loop ran out of turns or of total tokens.
FINISH_REASONS = ("stop", "length", "max_turns", "max_tokens")


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    """Model and tool tokens, in order."""
    response_mask: list[float] = dataclasses.field(default_factory=list)
    """Per response token: 1.0 sampled by the model, 0.0 tool output."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """Per response token: the engine's log-prob (0.0 for tool tokens)."""
    versions: list[int] = dataclasses.field(default_factory=list)
    """Per response token: the weight version it was sampled with (-1 for tool tokens)."""
    finish_reason: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    response_text: str = ""
    """What the judgers score: the whole response (single turn) or the final answer after the last tool
    result (tool loop; the full transcript is in metadata["transcript"]), without special tokens."""
    response_raw: str = ""
    """``response_text`` as decoded with its special tokens ("46</s>"): a reward that names a
    ``response_raw`` parameter gets it (rlmega.rewards.format.ends_with_eos)."""
    metadata: dict = dataclasses.field(default_factory=dict)
    scores: dict = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    judge_error: str | None = None
    routed_experts: torch.Tensor | None = None
    """MoE routing replay: (len(prompt_ids) + len(response_ids), num_moe_layers, topk) int16, the engine's
    routes (rlmega.rollout.rollout.Sample.routed_experts); -1 rows for tool-output tokens (routed by
    the trainer) and where the engine recorded none (the last token). None when not recorded. A tensor,
    so that a checkpoint of the async buffer (plain data + tensors) keeps it."""
    vision: dict | None = None
    """A trajectory with image observations: its own image inputs (the prompt's images, then the observations';
    rlmega/agents/image_observations.py). None: the group's."""

    def append(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None,
        versions: Sequence[int] | int,
        model: bool,
        routes: np.ndarray | None = None,
    ) -> None:
        """Add a model turn (its sampled ids, log-probs and the weight version of each token, or one
        version for all; ``routes``: its sample's ``routed_experts``, rows for the turn's context + ids)
        or a tool result (model=False)."""
        if isinstance(versions, int):
            versions = [versions] * len(ids)
        if model and len(versions) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(versions)} weight versions")
        self.response_ids.extend(ids)
        self.response_mask.extend([1.0 if model else 0.0] * len(ids))
        self.logprobs.extend(logprobs if model else [0.0] * len(ids))
        self.versions.extend(list(versions) if model else [-1] * len(ids))
        if routes is not None or self.routed_experts is not None:
            self._add_routes(routes)

    def _add_routes(self, routes: np.ndarray | None) -> None:
        """Lay a turn's rows over the trajectory's (a later turn re-reads the earlier tokens as its prompt:
        its rows are the latest computation of them, as within a cut request), then -1 on tool tokens."""
        n = len(self.prompt_ids) + len(self.response_ids)
        old = self.routed_experts
        shape = (routes if routes is not None else old).shape[1:]
        rows = torch.full((n, *shape), -1, dtype=torch.int16)
        if old is not None:
            rows[: min(len(old), n)] = old[:n]
        if routes is not None:
            new = torch.from_numpy(np.asarray(routes, dtype=np.int16))[:n]
            computed = new[:, 0, 0] != -1
            rows[: len(new)][computed] = new[computed]
        # not generated by the engine: the trainer routes them
        tool = torch.tensor(self.response_mask) == 0.0
        rows[len(self.prompt_ids) :][tool] = -1
        self.routed_experts = rows


@dataclasses.dataclass
class TrajectoryGroup:
    """The n trajectories of one prompt, or why the group could not be produced."""

    task: str
    prompt_index: int
    """The prompt's position in the step (its GRPO group id)."""
    label: Any
    trajectories: list[Trajectory] = dataclasses.field(default_factory=list)
    error: str | None = None
    """Set when a generation failed after its retries: the group is dropped, never trained on."""
    vision: dict | None = None
    """A vision-language prompt's image tensors (the processor's), shared by the group's trajectories."""


def staleness(t: Trajectory, step: int) -> int:
    """Weight versions between the trainer at ``step`` (its weights are version ``step``) and the
    trajectory's oldest sampled token; 0 for a trajectory without sampled tokens."""
    sampled = [v for v in t.versions if v >= 0]
    return step - min(sampled) if sampled else 0


def kept_trajectories(
    groups: Sequence[TrajectoryGroup],
) -> list[tuple[TrajectoryGroup, Trajectory]]:
    """The rows of ``batch_from_groups``, in order: trajectories with response tokens of the groups that
    succeeded."""
    return [(g, t) for g in groups if g.error is None for t in g.trajectories if t.response_ids]


def batch_from_groups(groups: Sequence[TrajectoryGroup]) -> RolloutBatch:
    """The trainer's batch from the groups that succeeded; a trajectory without response tokens is
    dropped (nothing to score). Group ids are the prompts' indices in the step."""
    kept = kept_trajectories(groups)
    # a trajectory's own: image observations
    vision = [g.vision if t.vision is None else t.vision for g, t in kept]
    return RolloutBatch(
        routed_experts=routes_of(
            [t.routed_experts for _, t in kept],
            [len(t.prompt_ids) + len(t.response_ids) for _, t in kept],
        ),
        tokens=[torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.int64) for _, t in kept],
        prompt_lens=torch.tensor([len(t.prompt_ids) for _, t in kept], dtype=torch.int64),
        response_mask=[torch.tensor(t.response_mask, dtype=torch.float32) for _, t in kept],
        rollout_logprobs=[torch.tensor(t.logprobs, dtype=torch.float32) for _, t in kept],
        rewards=torch.tensor([t.reward for _, t in kept], dtype=torch.float32),
        group_ids=torch.tensor([g.prompt_index for g, _ in kept], dtype=torch.int64),
        sample_ids=torch.arange(len(kept), dtype=torch.int64),
        vision=vision if any(v is not None for v in vision) else None,
    )
