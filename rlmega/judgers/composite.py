"""CompositeJudger: the judgers of one agent loop, run together on each trajectory and combined by weight.

    judge = CompositeJudger([NativeJudger("math", "rlmega.rewards.math.score", weight=1.0),
                             NativeJudger("format", "rlmega.rewards.format.boxed", weight=0.2)])
    j = await judge.judge(item)
    j.reward        # (1.0 * math + 0.2 * format) / 1.2
    j.scores        # {"math": ..., "format": ...} (and "<judger>/<score>" for extra named scores)
    judge.error_counts(reset=True)   # {"math": 0, "format": 2}: failed items per judger since the last reset

Each judger of the item runs concurrently. Scores: the union of the judgers' scores; every key is a
judger's name or "<name>/<score>" (base.py), so judgers with distinct names never clash. A key a custom
Judger returns outside that form is prefixed with its judger's name here. Reward: sum(w_i * r_i) /
sum(w_i); a failed judger contributes reward 0 (its Judgement's) with full weight, so a failure lowers
the reward rather than letting the others' verdict stand alone. Error: the failed judgers' errors
joined by "; ", None when all succeeded.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from rlmega.judgers.base import Judgement, Judger, JudgeItem


class CompositeJudger:
    def __init__(self, judgers: list[Judger]):
        if not judgers:
            raise ValueError("a CompositeJudger needs at least one judger")
        names = [j.name for j in judgers]
        if len(set(names)) != len(names):
            raise ValueError(f"judger names must be distinct: {names}")
        total = sum(j.weight for j in judgers)
        if not total > 0:
            raise ValueError(f"judger weights {[j.weight for j in judgers]} must sum to > 0")
        self.judgers, self.total_weight = list(judgers), total
        self._errors: Counter[str] = Counter({n: 0 for n in names})
        self.judged = 0  # items judged since the last reset of the counts

    @property
    def names(self) -> list[str]:
        return [j.name for j in self.judgers]

    async def ready(self) -> None:
        """Wait for every judger to be able to take items (engines, actors); raises if one cannot."""
        await asyncio.gather(*(j.ready() for j in self.judgers))

    async def judge(self, item: JudgeItem) -> Judgement:
        verdicts = await asyncio.gather(*(j.judge(item) for j in self.judgers))
        scores: dict[str, float] = {}
        errors = []
        for judger, verdict in zip(self.judgers, verdicts):
            for key, value in verdict.scores.items():
                if key != judger.name and not key.startswith(judger.name + "/"):
                    key = f"{judger.name}/{key}"
                scores[key] = value
            if verdict.error is not None:
                self._errors[judger.name] += 1
                errors.append(verdict.error)
        self.judged += 1
        reward = (
            sum(j.weight * v.reward for j, v in zip(self.judgers, verdicts)) / self.total_weight
        )
        return Judgement(scores=scores, reward=reward, error="; ".join(errors) if errors else None)

    async def judge_many(self, items: list[JudgeItem]) -> list[Judgement]:
        """`judge` on every item concurrently; verdicts in item order."""
        return list(await asyncio.gather(*(self.judge(it) for it in items)))

    def error_counts(self, reset: bool = False) -> dict[str, int]:
        """Failed items per judger name (every judger listed, 0 when none), since the last reset."""
        out = dict(self._errors)
        if reset:
            self._errors = Counter({n: 0 for n in self.names})
            self.judged = 0
        return out

    def close(self) -> None:
        for judger in self.judgers:
            judger.close()

    async def aclose(self) -> None:
        await asyncio.gather(*(j.aclose() for j in self.judgers))

    def __repr__(self) -> str:
        return (
            f"CompositeJudger({', '.join(f'{j.name}:{j.kind}*{j.weight:g}' for j in self.judgers)})"
        )
