"""A batch planned once into packed micro-batches per data-parallel rank, and each rank's share of it.

The driver plans a step's batch once (``plan_step``, from the samples' lengths and the trainer's
``Layout``) and sends each data-parallel rank only its ``Shard``: its samples (and the placeholder's
tokens when it runs one), its micro-batches as index lists into them, and the plan's padding efficiency.
Every rank of that data-parallel rank (its tensor and pipeline peers) gets the same shard; the ranks
build the micro-batches' tensors (rlmega.data.micro_batches.build_micro_batch) and answer per-sample
results for the shard's own samples, which the driver puts back in batch order (``StepPlan.merge``).

    layout = Layout(dp_size=2, max_tokens=2048)             # what the trainer's engine says of itself
    plan = plan_step(batch.lengths(), layout)               # once per batch: pure, deterministic
    shard = plan.shard(batch, dp_rank=1)                    # what data-parallel rank 1 receives
    full = plan.merge([per_sample_of_rank0, per_sample_of_rank1])   # results in batch order

A rank given the whole batch (tests, one process) plans it the same way itself and takes its own shard
(rlmega/learner/policy_actor.py), so both paths run exactly the same micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rlmega.data.micro_batches import micro_batch_shape
from rlmega.data.packing import padding_efficiency, placeholder_sample, plan_micro_batches
from rlmega.data.rollout_batch import RolloutBatch


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a trainer's engine wants a batch split: what plan_step needs, the same on every rank."""

    dp_size: int
    """Data-parallel ranks: the plan's shares."""
    max_tokens: int
    """Token budget of one packed micro-batch."""
    multiple_of: int = 1
    """Each rank's micro-batch count is a multiple of this (Megatron's interleaved schedule: PP)."""
    equal_counts: bool = False
    """Every data-parallel rank runs as many micro-batches, placeholders filling in (FSDP2: each forward
    all-gathers; Megatron at expert parallelism > 1: each MoE layer dispatches over the EP group)."""
    equal_shapes: bool = False
    """The k-th micro-batch of every rank has one shape (Megatron's allgather MoE dispatcher)."""
    row_multiple: int = 1
    """Each packed row is padded to a multiple of this many tokens (Megatron's sequence parallelism: TP,
    each TP rank holding an equal part of the row)."""


@dataclasses.dataclass
class Shard:
    """One data-parallel rank's share of a batch (see the module docstring)."""

    batch: RolloutBatch
    """The rank's samples, in batch order, plus the placeholder's sample when one of its micro-batches is
    a placeholder and the sample is not its own."""
    micro_batches: list[list[int]]
    """Each micro-batch's sample positions in ``batch`` ([] a placeholder)."""
    shapes: list[tuple[int, int] | None]
    """Each micro-batch's minimum (rows, tokens), or None."""
    efficiency: float
    """Real tokens / computed tokens of the whole plan (every rank's)."""
    own: list[int]
    """Positions in ``batch`` of the rank's own samples: what its per-sample results are for, in order."""
    samples: list[int]
    """Their indices in the whole batch (``StepPlan.merge`` puts the results back there)."""


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Every data-parallel rank's micro-batches of one batch (indices into it) and their shapes."""

    per_rank: list[list[list[int]]]
    shapes: list[tuple[int, int] | None]
    efficiency: float
    placeholder: int
    size: int

    def shard(self, batch: RolloutBatch, dp_rank: int, whole: bool = False) -> Shard:
        """Data-parallel rank ``dp_rank``'s share of ``batch`` (the batch this plan was made for, with any
        fields: a train step's carries its advantages, old log-probs, ...). ``whole``: keep the whole batch
        in the shard (a rank that was given all of it: its micro-batches index the batch itself)."""
        if len(batch) != self.size:
            raise ValueError(f"a plan for {self.size} samples cannot shard a batch of {len(batch)}")
        mbs = self.per_rank[dp_rank]
        mine = sorted(i for mb in mbs for i in mb)
        if whole:
            return Shard(
                batch,
                [list(mb) for mb in mbs],
                list(self.shapes),
                self.efficiency,
                own=mine,
                samples=mine,
            )
        # the placeholder's tokens travel only to a rank that runs one, and build it as the whole batch would:
        # the shortest sample, lowest index first, is the shortest of any subset holding it
        keep = sorted(set(mine) | ({self.placeholder} if any(not mb for mb in mbs) else set()))
        local = {g: k for k, g in enumerate(keep)}
        return Shard(
            batch.select(keep),
            [[local[i] for i in mb] for mb in mbs],
            list(self.shapes),
            self.efficiency,
            own=[local[i] for i in mine],
            samples=mine,
        )

    def merge(self, per_rank: Sequence[Sequence[Any]]) -> list:
        """Each data-parallel rank's per-sample results (for its shard's ``samples``, in order) -> one list
        in batch order."""
        out: list = [None] * self.size
        for mbs, results in zip(self.per_rank, per_rank):
            samples = sorted(i for mb in mbs for i in mb)
            if len(samples) != len(results):
                raise ValueError(f"{len(results)} results for a share of {len(samples)} samples")
            for i, r in zip(samples, results):
                out[i] = r
        return out


def plan_step(lengths: list[int], layout: Layout) -> StepPlan:
    """The micro-batches of a batch of samples with ``lengths`` on every data-parallel rank of ``layout``:
    balanced by tokens, packed under its budget (rlmega.data.packing.plan_micro_batches), placeholders
    where a rank has too few samples or must match the others' counts, shapes made equal where the
    layout asks. Deterministic: the same lengths and layout give the same plan wherever it is made."""
    plan = plan_micro_batches(
        lengths, layout.max_tokens, layout.dp_size, multiple_of=layout.multiple_of, allow_empty=True
    )
    if layout.equal_counts:
        count = max(len(p) for p in plan)
        plan = [p + [[] for _ in range(count - len(p))] for p in plan]
    shapes: list = [None] * max(len(p) for p in plan)
    if layout.equal_shapes:
        per_rank = [
            [micro_batch_shape(lengths, idx, layout.row_multiple) for idx in p] for p in plan
        ]
        shapes = [tuple(max(s[j][d] for s in per_rank) for d in (0, 1)) for j in range(len(shapes))]
    return StepPlan(
        plan,
        shapes,
        padding_efficiency(lengths, plan, layout.row_multiple),
        placeholder_sample(lengths),
        len(lengths),
    )
