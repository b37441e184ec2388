"""A step's rollout metrics from its trajectory groups (pure: groups in, a flat dict out).

Keys: task/<name>/reward_mean, task/<name>/response_length (response tokens, model + tool),
score/<judger score> (mean over trajectories), judge_errors (trajectories a judger failed on),
groups_dropped (groups lost to failed generations), finish/<reason> (fraction of trajectories),
turns_mean, tool_calls_mean (tool loops). Dropped groups count nowhere else.

``staleness_metrics``: staleness_mean, staleness_max, staleness/<k> (trajectories k weight versions
behind the trainer) and partial_rollouts (trajectories whose sampled tokens span several versions).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from rlmega.agents.trajectory import TrajectoryGroup, staleness


def rollout_metrics(groups: Sequence[TrajectoryGroup], task_names: Sequence[str]) -> dict:
    kept = [(g.task, t) for g in groups if g.error is None for t in g.trajectories]
    out: dict = {
        "groups_dropped": sum(g.error is not None for g in groups),
        "judge_errors": sum(t.judge_error is not None for _, t in kept),
    }
    by_task: dict = defaultdict(list)
    for task, t in kept:
        by_task[task].append(t)
    for name in task_names:
        ts = by_task.get(name, [])
        out[f"task/{name}/reward_mean"] = (
            sum(t.reward for t in ts) / len(ts) if ts else float("nan")
        )
        out[f"task/{name}/response_length"] = (
            sum(len(t.response_ids) for t in ts) / len(ts) if ts else float("nan")
        )
    scores: dict = defaultdict(list)
    for _, t in kept:
        for k, v in t.scores.items():
            scores[k].append(float(v))
    out.update({f"score/{k}": sum(v) / len(v) for k, v in sorted(scores.items())})
    n = max(len(kept), 1)
    out.update(
        {f"finish/{r}": c / n for r, c in sorted(Counter(t.finish_reason for _, t in kept).items())}
    )
    out["turns_mean"] = sum(t.num_turns for _, t in kept) / n
    out["tool_calls_mean"] = sum(t.tool_calls for _, t in kept) / n
    return out


def staleness_metrics(groups: Sequence[TrajectoryGroup], step: int) -> dict:
    """Of the trajectories trained at ``step`` (0-based: the trainer holds weights version ``step``)."""
    kept = [t for g in groups if g.error is None for t in g.trajectories]
    values = [staleness(t, step) for t in kept]
    out: dict = {
        "staleness_mean": sum(values) / len(values) if values else 0.0,
        "staleness_max": max(values, default=0),
        "partial_rollouts": sum(len({v for v in t.versions if v >= 0}) > 1 for t in kept),
    }
    out.update({f"staleness/{k}": c for k, c in sorted(Counter(values).items())})
    return out
