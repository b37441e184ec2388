"""Load-time checks of the agent side: agent loops (their tools, limits, hosting), their judgers and the
task mix. Called by rlmega.config.validate; each problem names the field and the fix. With them the rule
that shares a step's prompts among the tasks (split_by_weight: rlmega.agents.tasks draws by it, and a task
whose share rounds to 0 is refused here)."""

from __future__ import annotations

import math
import os

from rlmega.config.agent_rules import MAX_MEMORY_MB, MAX_TIMEOUT_S, MIN_MEMORY_MB, TOOL_NAMES
from rlmega.config.finite import finite_number
from rlmega.config.judger_rules import validate_judgers
from rlmega.config.errors import MAX_ACTORS, problem


def split_by_weight(total: int, weights: list[float]) -> list[int]:
    """``total`` items shared by weight, largest remainder first (ties: earlier task).

    split_by_weight(4, [1, 1]) -> [2, 2]; split_by_weight(5, [2, 1]) -> [3, 2]; sums to total."""
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


# the sequence task's labels (synthetic_size x synthetic_length) live in the driver
MAX_SYNTHETIC_CHARACTERS = 2**31


def synthetic_problems(data, field: str, rollout) -> list[str]:
    """The synthetic sequence task of ``data`` (field: "data" or "tasks[i].data") fits the run."""
    if data.train_path or data.synthetic_task != "sequence":
        return []
    out = []
    if rollout.max_response_tokens < data.synthetic_length:
        out.append(
            problem(
                f"{field}.synthetic_length",
                f"{data.synthetic_length} letters per answer, but "
                f"rollout.max_response_tokens={rollout.max_response_tokens} cuts every response shorter",
                f"set rollout.max_response_tokens >= {data.synthetic_length}, or shorten the answers",
            )
        )
    if data.synthetic_size * data.synthetic_length > MAX_SYNTHETIC_CHARACTERS:
        out.append(
            problem(
                f"{field}.synthetic_size",
                f"{data.synthetic_size} answers of {data.synthetic_length} "
                f"letters are more than {MAX_SYNTHETIC_CHARACTERS} characters held in the driver",
                "lower data.synthetic_size: there are only 26 prompts",
            )
        )
    return out


def agent_loop_problems(loop, field: str, rollout, reward) -> list[str]:
    out = []
    if loop.num_ray_actors < 0:
        out.append(
            problem(
                f"{field}.num_ray_actors",
                f"{loop.num_ray_actors} is negative",
                "0 runs the loop in the driver's process, 1 in one Ray actor, N > 1 in N actors",
            )
        )
    if loop.kind == "tool":
        for i, name in enumerate(loop.tools):
            if name not in TOOL_NAMES:
                out.append(
                    problem(
                        f"{field}.tools[{i}]",
                        f"no tool named {name!r}",
                        f"use one of {', '.join(TOOL_NAMES)}",
                    )
                )
        if not loop.tools:
            out.append(
                problem(
                    f"{field}.tools",
                    "a tool loop without tools",
                    "name at least one tool, e.g. [calculator]",
                )
            )
        if loop.max_turns < 1:
            out.append(problem(f"{field}.max_turns", f"{loop.max_turns}", "set max_turns >= 1"))
        if loop.max_total_tokens < 0 or loop.max_total_tokens > rollout.max_response_tokens:
            out.append(
                problem(
                    f"{field}.max_total_tokens",
                    f"{loop.max_total_tokens}, outside 0..rollout.max_response_tokens "
                    f"({rollout.max_response_tokens}): the engine holds at most that many response tokens",
                    "set it within that range (0 = rollout.max_response_tokens)",
                )
            )
        # NaN would fail every call, a limit past the bounds limits nothing (10**8 MiB of address space).
        # The bounds are the tools' own (rlmega/config/agent_rules.py; rlmega.agents.tools refuses a call
        # outside them).
        for name, ok, span in (
            ("tool_timeout_s", lambda v: 0 < v <= MAX_TIMEOUT_S, f"(0, {MAX_TIMEOUT_S:g}] s"),
            (
                "tool_memory_mb",
                lambda v: MIN_MEMORY_MB <= v <= MAX_MEMORY_MB,
                f"[{MIN_MEMORY_MB}, {MAX_MEMORY_MB}] MiB",
            ),
        ):
            v = getattr(loop, name)
            if not (finite_number(v) and ok(v)):
                out.append(
                    problem(
                        f"{field}.{name}",
                        f"{v!r} is not in {span}",
                        f"set {field}.{name} within {span}",
                    )
                )
    if loop.num_ray_actors > MAX_ACTORS:
        out.append(
            problem(
                f"{field}.num_ray_actors",
                f"{loop.num_ray_actors} actors, more than {MAX_ACTORS}",
                f"use at most {MAX_ACTORS} (each actor is a process with its own judgers)",
            )
        )
    if (
        not (finite_number(loop.cpus_per_actor) and loop.cpus_per_actor > 0)
        and loop.num_ray_actors > 0
    ):
        out.append(
            problem(f"{field}.cpus_per_actor", f"{loop.cpus_per_actor}", "set cpus_per_actor > 0")
        )
    if loop.memory_mb_per_actor < 0:
        out.append(
            problem(
                f"{field}.memory_mb_per_actor",
                f"{loop.memory_mb_per_actor}",
                "set it >= 0 (0: none)",
            )
        )
    if loop.max_generation_retries < 0:
        out.append(
            problem(
                f"{field}.max_generation_retries", f"{loop.max_generation_retries}", "set it >= 0"
            )
        )
    out += validate_judgers(loop.judgers, f"{field}.judgers", reward)
    return out


def task_problems(cfg) -> list[str]:
    """The agent_loop section (default task) or every task of cfg.tasks, and the mix's weights."""
    if not cfg.tasks:
        return agent_loop_problems(
            cfg.agent_loop, "agent_loop", cfg.rollout, cfg.reward
        ) + synthetic_problems(cfg.data, "data", cfg.rollout)
    out, names = [], set()
    for i, t in enumerate(cfg.tasks):
        f = f"tasks[{i}]"
        if not t.name or t.name in names:
            out.append(
                problem(
                    f"{f}.name",
                    f"{t.name!r} is empty or used by an earlier task",
                    "give each task its own name",
                )
            )
        names.add(t.name)
        if not (finite_number(t.weight) and t.weight >= 0):
            out.append(
                problem(
                    f"{f}.weight",
                    f"{t.weight} is not a finite number >= 0",
                    "give each task a finite weight >= 0",
                )
            )
        out += agent_loop_problems(t.agent_loop, f"{f}.agent_loop", cfg.rollout, cfg.reward)
        out += synthetic_problems(t.data, f"{f}.data", cfg.rollout)
        for key in ("train_path", "eval_path"):
            path = getattr(t.data, key)
            if path and not os.path.isfile(path):
                out.append(
                    problem(
                        f"{f}.data.{key}",
                        f"prompt file {path!r} does not exist",
                        'give an existing JSONL or Parquet file, or "" for data.synthetic_task',
                    )
                )
    weights = [t.weight for t in cfg.tasks]
    if not all(finite_number(w) for w in weights):
        pass  # named above; the shares below divide by their sum
    elif not sum(weights) > 0:
        out.append(
            problem(
                "tasks",
                f"the task weights {weights} do not sum to a positive number",
                "give at least one task a positive weight",
            )
        )
    elif not out:
        for t, k in zip(cfg.tasks, split_by_weight(cfg.trainer.prompts_per_step, weights)):
            if k == 0 and t.weight > 0:
                out.append(
                    problem(
                        f"tasks[{cfg.tasks.index(t)}].weight",
                        f"task {t.name!r} gets 0 of trainer.prompts_per_step={cfg.trainer.prompts_per_step} "
                        "prompts per step",
                        "raise its weight or trainer.prompts_per_step",
                    )
                )
    return out
