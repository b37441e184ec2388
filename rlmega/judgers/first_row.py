"""Each task's reward functions, called once on the first prompt row, as `rlmega check-config` does before any
worker starts (issue 56): a function that raises, returns text, or needs an argument it never gets fails here,
naming the row and the line that raised, not at step 1 on every trajectory.

    problems = first_row_problems(cfg.reward, tasks, bool(cfg.tasks))  # [] or one problem per failing judger

The response it is given is the row's label as text (a right answer: a sensible reward scores it without
raising). Native and ray judgers only: their function runs here, in a thread, bounded by its timeout_s; an
http judger's service and a model judge's engine are not started for this.
"""

from __future__ import annotations

import asyncio

from rlmega.config.errors import problem
from rlmega.config.schema import RewardConfig
from rlmega.judgers.base import JudgeItem
from rlmega.judgers.factory import default_judgers
from rlmega.judgers.native import NativeJudger


def first_row_problems(reward: RewardConfig, tasks, named_tasks: bool) -> list[str]:
    """Problems (rlmega.config.errors.problem) of the function judgers of every task in ``tasks``
    (rlmega.agents.tasks.Tasks) on that task's first training prompt; [] when each scored it. ``reward``: the
    reward section (the default judgers); ``named_tasks``: the config has a tasks list (the fields' names)."""
    out = []
    for t in tasks.configs:
        prompt = tasks.data[t.name].train[0]
        where = f"row {prompt.index + 1} of {t.data.train_path or 'the synthetic ' + t.data.synthetic_task + ' rows'}"
        item = JudgeItem(
            prompt_text=prompt.text,
            response_text=str(prompt.label),
            response_raw=str(prompt.label),
            label=prompt.label,
            prompt_ids=list(prompt.token_ids),
            images=tuple(prompt.images),
            metadata={"task": t.name, "finish_reason": "stop"},
            columns=dict(prompt.columns),
        )
        custom = bool(t.agent_loop.judgers)
        prefix = f"tasks[{t.name}].agent_loop.judgers" if named_tasks else "agent_loop.judgers"
        for i, c in enumerate(t.agent_loop.judgers or default_judgers(reward)):
            if c.kind not in ("native", "ray"):
                continue
            fn = c.fn or reward.fn
            verdict = asyncio.run(
                NativeJudger(c.name, fn, kwargs=c.kwargs, timeout_s=c.timeout_s).judge(item)
            )
            if verdict.error is not None:
                out.append(
                    problem(
                        f"{prefix}[{i}].fn" if custom and c.fn else "reward.fn",
                        f"{fn} failed on {where}, given its label {prompt.label!r} as the response: "
                        f"{verdict.error.split(': ', 1)[-1]}",
                        "correct the function: it must return a number, or a dict holding 'reward', "
                        "for every response",
                    )
                )
    return out
