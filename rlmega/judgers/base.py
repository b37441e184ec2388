"""What a judger sees (JudgeItem), what it returns (Judgement), and the base class every kind shares.

    judger = NativeJudger("math", "rlmega.rewards.math.score", timeout_s=10)
    j = await judger.judge(JudgeItem(prompt_text="1+1=", response_text="\\boxed{2}", label="2"))
    j.reward, j.scores, j.error            # 1.0, {"math": 1.0}, None

A judger is user code (a function, a service, a model), so one trajectory's failure must not end a
run: `Judger.judge` never raises. It runs the subclass's `_judge` under `asyncio.wait_for(timeout_s)`
and turns an exception, a timeout or an unusable value into reward 0, `scores={name: 0.0}` and an
error string that names the judger and why ("judger 'math' (native): ZeroDivisionError: ...";
a judger's own machinery failing raises JudgeError, whose message stands without a type name); the
caller counts and flags such items. `ready()` (actors or an engine starting) is awaited first, outside
the item's clock.

Score names: a judger's reward is always `scores[name]`; the other named scores a function or service
returns ({"reward": r, "format": f}) become `scores["<name>/format"]`. Prefixing at the source keeps the
keys of one judger the same for every item and makes the union over judgers with distinct names (which
validation enforces) free of clashes (rlmega/judgers/composite.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass
class JudgeItem:
    """One finished trajectory, as the judger sees it."""

    prompt_text: str
    response_text: str
    """The generated text after the prompt, without special tokens (a tool loop's: its answer after the
    last tool result; the whole transcript is metadata["transcript"])."""
    label: Any = None
    """The dataset row's label (e.g. the reference answer)."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    """Anything else the agent loop knows (task name, finish reason, turns); passed to HTTP judgers."""
    response_raw: str = ""
    """``response_text`` with its special tokens, as the tokenizer decodes them ("46</s>")."""
    columns: dict = field(default_factory=dict)
    """The prompt row's other columns (not its prompt's nor its label's), by name."""
    images: tuple = ()
    """A vision-language prompt's images (encoded files), by reference: the loop's own objects (native judgers
    that name an ``images`` parameter get them; not sent to HTTP judgers)."""


@dataclass
class Judgement:
    """A judger's verdict on one item: named scores, the reward, and why it failed (None when it did not)."""

    scores: dict[str, float]
    reward: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _FunctionTimeout(Exception):
    """A TimeoutError raised by the judged code itself (its __cause__), not by the judger's deadline."""


class RewardError(RuntimeError):
    """A judger failed on a trajectory and reward.on_error=fail: the run ends naming it (rlmega.step)."""


class JudgeError(RuntimeError):
    """A judger's own machinery failed (an actor died, a service answered 500, an engine failed): its
    message is the whole story, so the error string carries no exception type name."""


# What a subclass's _judge may return: a number, a mapping of named scores holding "reward", or a
# ready Judgement (a Ray actor's, already named and checked).
RawVerdict = Union[float, int, Mapping[str, Any], Judgement]


def _finite(value: Any, what: str) -> float:
    if isinstance(value, str):  # float("1") would accept text: a function returning "1" is a bug
        raise TypeError(f"{what} is {value!r}, not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} is {value!r}, not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"{what} is {out}")
    return out


def to_judgement(name: str, value: RawVerdict) -> Judgement:
    """Check a raw verdict and name its scores: a number r -> {name: r}; {"reward": r, "k": v, ...} ->
    {name: r, "name/k": v, ...}. TypeError/ValueError when it is neither, or a value is not finite."""
    if isinstance(value, Judgement):
        return value
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"returned the scores {sorted(map(str, value))} without a 'reward'")
        reward = _finite(value["reward"], "'reward'")
        scores = {name: reward}
        for key, v in value.items():
            if key != "reward":
                scores[f"{name}/{key}"] = _finite(v, f"score {key!r}")
        return Judgement(scores=scores, reward=reward)
    reward = _finite(value, "the result")
    return Judgement(scores={name: reward}, reward=reward)


_HERE = os.path.dirname(os.path.abspath(__file__))


def raised_at(e: BaseException) -> str:
    """ " (raised at FILE:LINE)": the innermost frame of ``e``'s traceback, the line of the user's reward that
    raised; "" when that frame is the judgers' own code (their messages say what is wrong) or unknown."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames or os.path.dirname(os.path.abspath(frames[-1].filename)) == _HERE:
        return ""
    return f" (raised at {frames[-1].filename}:{frames[-1].lineno})"


def failed(name: str, error: str) -> Judgement:
    """The verdict of an item whose judging failed: reward 0 under the judger's name, flagged."""
    return Judgement(scores={name: 0.0}, reward=0.0, error=error)


class Judger:
    """Base of every judger kind. Subclasses implement `async _judge(item)` returning a RawVerdict;
    callers use `judge`, which bounds it by `timeout_s` and never raises (see the module doc)."""

    kind = "base"

    def __init__(self, name: str, *, timeout_s: float = 60.0, weight: float = 1.0):
        if not timeout_s > 0:
            raise ValueError(f"judger {name!r}: timeout_s={timeout_s} must be > 0")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"judger {name!r}: weight={weight} must be a finite number >= 0")
        self.name, self.timeout_s, self.weight = name, float(timeout_s), float(weight)

    @property
    def deadline_s(self) -> float:
        """The wall-clock bound `judge` puts on `_judge`; kinds that enforce timeout_s further away
        (a Ray actor) give their round trip some slack on top."""
        return self.timeout_s

    def _error(self, why: str) -> str:
        return f"judger {self.name!r} ({self.kind}): {why}"

    async def judge(self, item: JudgeItem) -> Judgement:
        """The verdict on `item`; failures come back as reward 0 with `error` set, never raised."""
        try:
            # before the item's clock starts: a judge engine may take minutes to start
            await self.ready()
        except Exception as e:
            why = str(e) if isinstance(e, JudgeError) else f"{type(e).__name__}: {e}"
            return failed(self.name, self._error(f"not ready: {why}"))
        try:
            raw = await asyncio.wait_for(self._own_timeouts_apart(item), self.deadline_s)
            return to_judgement(self.name, raw)
        except TimeoutError:  # only wait_for's own: the function's are _FunctionTimeout here
            within = f"timeout_s={self.timeout_s:g}s"
            if self.deadline_s != self.timeout_s:
                within = f"{self.deadline_s:g}s ({within} plus the round trip)"
            return failed(self.name, self._error(f"no result within {within}"))
        except _FunctionTimeout as e:
            cause = e.__cause__
            return failed(self.name, self._error(f"{type(cause).__name__}: {cause}"))
        except JudgeError as e:
            return failed(self.name, self._error(str(e)))
        # user code: keep its type, message and where it raised for the error flag
        except Exception as e:
            return failed(self.name, self._error(f"{type(e).__name__}: {e}{raised_at(e)}"))

    async def _own_timeouts_apart(self, item: JudgeItem) -> RawVerdict:
        # A TimeoutError the judged function raises itself must not read as the deadline passing (timing
        # the call cannot tell them apart under load: the first version did, and failed that way).
        try:
            return await self._judge(item)
        except TimeoutError as e:
            raise _FunctionTimeout() from e

    async def judge_many(self, items: list[JudgeItem]) -> list[Judgement]:
        """`judge` on every item concurrently; verdicts in item order."""
        return list(await asyncio.gather(*(self.judge(it) for it in items)))

    async def _judge(self, item: JudgeItem) -> RawVerdict:
        raise NotImplementedError

    async def ready(self) -> None:
        """Wait until the judger can take items (its actors or engine have started); `judge` awaits it
        first, outside the item's timeout. Raises when the judger cannot start. The default is ready."""

    def close(self) -> None:
        """Release what the judger holds (actors, connections); the default holds nothing."""

    async def aclose(self) -> None:
        """`close` from inside an event loop (kinds with async resources override it)."""
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, timeout_s={self.timeout_s:g}, weight={self.weight:g})"
