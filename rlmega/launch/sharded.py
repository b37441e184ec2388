"""A trainer group's calls on a batch, made as one planned share per data-parallel rank.

    calls = ShardedCalls(group, group.call("data_layout"))   # each rank's (Layout, data-parallel rank)
    lp = calls.submit("compute_logprobs", batch)()            # planned here once, one share each, merged

The batch is planned once (rlmega/data/shards.py: cached by its samples' lengths, so a step's
log-prob, reference and train calls on one batch share the plan) and each data-parallel rank receives only
its share; the results come back per share and are put back in batch order: a list (per-sample results),
each list of a tuple, and each list value of a dict (a train step's on-policy "old_logprobs"; its other
values are global, the same on every rank, and taken from data-parallel rank 0).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.shards import Layout, StepPlan, plan_step

_PLANS_KEPT = 4  # a step's batch and its mini-batches


class ShardedCalls:
    def __init__(self, group, layouts: list[tuple[Layout, int]]):
        """``layouts``: every rank's ``data_layout()``: (the engine's Layout, its data-parallel rank)."""
        kinds = {layout for layout, _ in layouts}
        if len(kinds) != 1:
            raise RuntimeError(
                f"trainer ranks disagree on how to split a batch: {sorted(map(str, kinds))}"
            )
        self.group, self.layout = group, kinds.pop()
        self.dp_of_rank = [dp for _, dp in layouts]
        self._plans: collections.OrderedDict = collections.OrderedDict()

    def plan(self, batch: RolloutBatch) -> StepPlan:
        key = tuple(batch.lengths())
        if key not in self._plans:
            self._plans[key] = plan_step(list(key), self.layout)
            while len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return self._plans[key]

    def submit(self, method: str, batch: RolloutBatch, *args, **kwargs) -> Callable[[], Any]:
        """``method(share, *args, **kwargs)`` on every rank, started now; returns the function that waits and
        gives the merged result."""
        plan = self.plan(batch)
        shards = [plan.shard(batch, d) for d in range(self.layout.dp_size)]
        wait = self.group.submit_shards(method, shards, self.dp_of_rank, *args, **kwargs)
        return lambda: merge(plan, wait())


def merge(plan: StepPlan, per_dp: list) -> Any:
    """Each data-parallel rank's answer -> one answer over the whole batch (see the module docstring)."""
    first = per_dp[0]
    if isinstance(first, list):
        return plan.merge(per_dp)
    if isinstance(first, tuple):
        return tuple(merge(plan, [r[k] for r in per_dp]) for k in range(len(first)))
    if isinstance(first, dict):
        return {
            k: plan.merge([r[k] for r in per_dp]) if isinstance(v, list) else v
            for k, v in first.items()
        }
    return first
