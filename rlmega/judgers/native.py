"""NativeJudger: a reward function called in the agent loop's own process.

    judger = NativeJudger("math", "rlmega.rewards.math.score", kwargs={}, timeout_s=10)

The function is `fn(response_text, label, **kwargs)` returning a number, or a dict of named scores
that holds "reward" (rlmega/judgers/base.py names them); response_text is decoded without special tokens.
It is resolved when the judger is built, so a bad dotted path fails then, not at the first trajectory. A
function that names a parameter `prompt`, `metadata`, `images`, `response_raw`, `response_ids` or
`prompt_ids` also gets the item's prompt text, metadata (a tool loop's whole transcript is
metadata["transcript"]), its prompt's images (a vision-language prompt's encoded image files, the objects the
loop holds: rlmega/data/images.py decode_images opens them), the response with its special tokens, the token
ids, or the row's other columns as a dict (`columns`); a parameter named for one of the row's columns gets
that column ("difficulty" for a row {"prompt", "label", "difficulty"}). All opt-in by name, so plain reward
functions (reward.fn) stay two-argument, and a column never lands in a ``**kwargs`` uninvited.

An `async def` function is awaited on the caller's event loop (it must not block it). A plain function
runs in a thread of its own, so a slow or hung one never stalls the loop. Why not `asyncio.to_thread`:
its executor has a fixed number of threads (min(32, cores + 4): 6 on a 2-core machine), a hung call
keeps its thread forever, and a few hung calls would starve every later item; those threads are also
joined at interpreter exit, so one hung call would keep the process alive. A hung call here is
abandoned when its timeout passes: its daemon thread ends with the function or with the process.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable

from rlmega.config.dotted_path import resolve
from rlmega.config.judger_rules import ITEM_PARAMETERS
from rlmega.judgers.base import Judger, JudgeItem, RawVerdict


# Parameters a function may name to get more of the item (rlmega/config/judger_rules.py): -> JudgeItem field.
ITEM_FIELDS = {p: "prompt_text" if p == "prompt" else p for p in ITEM_PARAMETERS}


def _parameters(fn: Callable) -> list[str]:
    """``fn``'s parameter names in order, ``*args``/``**kwargs`` left out."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def run_in_daemon_thread(
    fn: Callable[..., Any], args: tuple, kwargs: dict, thread_name: str = "judger"
) -> asyncio.Future:
    """A future for `fn(*args, **kwargs)` run in a new daemon thread; cancelling the future abandons it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled (timed out): nobody waits for this result any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value, error = fn(*args, **kwargs), None
        except Exception as e:  # handed to the awaiting coroutine
            value, error = None, e
        # SystemExit and kin would escape the judger's `except Exception`
        except BaseException as e:
            value, error = None, RuntimeError(f"raised {type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the call ran: nobody is left to tell
            pass

    threading.Thread(target=work, name=thread_name, daemon=True).start()
    return future


class NativeJudger(Judger):
    kind = "native"

    def __init__(
        self,
        name: str,
        fn: str | Callable,
        *,
        kwargs: dict | None = None,
        timeout_s: float = 60.0,
        weight: float = 1.0,
    ):
        super().__init__(name, timeout_s=timeout_s, weight=weight)
        self.fn_path = fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}"
        self.fn = resolve(fn, field=f"judger {name!r} fn") if isinstance(fn, str) else fn
        self.kwargs = dict(kwargs or {})
        self.is_async = inspect.iscoroutinefunction(self.fn)
        params = _parameters(self.fn)
        self.wants = {p for p in ITEM_FIELDS if p in params and p not in self.kwargs}
        # a column comes by its name to a parameter of that name that nothing else fills: not the first two
        # (the response and the label, whatever the function calls them), an item field, or a kwargs key
        self.column_names = set(params[2:]) - set(ITEM_FIELDS) - set(self.kwargs)

    async def _judge(self, item: JudgeItem) -> RawVerdict:
        kwargs = self.kwargs
        columns = {k: v for k, v in item.columns.items() if k in self.column_names}
        if self.wants or columns:
            kwargs = {**kwargs, **columns, **{p: getattr(item, ITEM_FIELDS[p]) for p in self.wants}}
        if self.is_async:
            return await self.fn(item.response_text, item.label, **kwargs)
        value = await run_in_daemon_thread(
            self.fn, (item.response_text, item.label), kwargs, thread_name=f"judger-{self.name}"
        )
        # a wrapped async function (a partial, a decorator) returns a coroutine
        if inspect.isawaitable(value):
            value = await value
        return value

    def __repr__(self) -> str:
        return (
            f"NativeJudger(name={self.name!r}, fn={self.fn_path!r}, timeout_s={self.timeout_s:g})"
        )
