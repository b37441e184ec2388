"""RayJudger: a reward function served by N Ray actors behind a least-outstanding router.

    judger = RayJudger("math", "rlmega.rewards.math.score", num_actors=4, cpus_per_actor=1,
                       memory_mb_per_actor=2048, placement_group=pg)   # pg: optional
    j = await judger.judge(item)

For functions too heavy for the agent loop's process (math-verify with sympy, a sandbox): each actor
(`JudgeActor`) hosts a NativeJudger, so scores, score names, the per-item timeout and the error strings
are exactly the native judger's; the actor is asynchronous, so it scores many items at once (a plain
function in a thread each, see native.py). Each actor reserves `cpus_per_actor` CPUs and
`memory_mb_per_actor` MiB (none when 0). Placement: `bundles`, one (placement group, bundle index)
per actor (as rlmega.agents.placement lays them out), or `placement_group` (any bundle with room), or
neither; a bundle must hold its actor's CPUs and memory.

Routing: an item goes to the actor with the fewest items in flight (ties: round robin).

A dead actor (its process crashed, OOM-killed, `ray.kill`): the first call that finds it dead starts a
replacement in the same slot (other calls in flight on it wait for that same replacement) and the item
is retried once there. If the replacement cannot start within `restart_timeout_s`, or dies too, the
item fails with "actor <i> died: ..." (reward 0, flagged) and the run goes on; the next item routed to
that slot tries again. `restarts` counts replacements.

Deadlines: the actor enforces timeout_s on the function; the caller's own deadline (`deadline_s`) adds
a restart and a retry, so it only fires when an actor stops answering altogether.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Sequence

import ray
from ray.exceptions import RayActorError

from rlmega.config.dotted_path import resolve
from rlmega.judgers.base import JudgeError, Judgement, Judger, JudgeItem, RawVerdict
from rlmega.judgers.native import NativeJudger

_MiB = 1 << 20


def first_line(e: BaseException, limit: int = 300) -> str:
    """A Ray error's first line: its full text carries pages of context."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


class JudgeActor:
    """The Ray-hosted side: one NativeJudger, asynchronous so items are judged concurrently."""

    def __init__(self, name: str, fn: str, kwargs: dict, timeout_s: float, index: int):
        self.judger = NativeJudger(name, fn, kwargs=kwargs, timeout_s=timeout_s)
        # error strings then say which actor judged the item
        self.judger.kind = f"ray actor {index}"

    async def judge(self, item: JudgeItem) -> Judgement:
        return await self.judger.judge(item)

    async def ready(self) -> dict:
        """Where this actor runs: its process id, placement group (None outside one) and the Ray
        resources it holds (in a bundle they are named e.g. CPU_group_<bundle>_<group id>)."""
        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "placement_group": ctx.get_placement_group_id(),
            "resources": ctx.get_assigned_resources(),
        }


class RayJudger(Judger):
    kind = "ray"

    def __init__(
        self,
        name: str,
        fn: str,
        *,
        kwargs: dict | None = None,
        timeout_s: float = 60.0,
        weight: float = 1.0,
        num_actors: int = 1,
        cpus_per_actor: float = 0.25,
        memory_mb_per_actor: int = 0,
        placement_group=None,
        bundles: Sequence[tuple] | None = None,
        restart_timeout_s: float = 60.0,
    ):
        super().__init__(name, timeout_s=timeout_s, weight=weight)
        if num_actors < 1:
            raise ValueError(f"judger {name!r}: num_actors={num_actors} must be >= 1")
        if not ray.is_initialized():
            # Ray would otherwise start a private local cluster on the first call, unasked.
            raise RuntimeError(
                f"judger {name!r} (ray) needs a running Ray: call ray.init() (or start the "
                "trainer's cluster) before building it"
            )
        # a bad path fails here, in the driver, not in N actors
        resolve(fn, field=f"judger {name!r} fn")
        self.fn_path, self.kwargs = fn, dict(kwargs or {})
        self.restart_timeout_s, self.restarts = float(restart_timeout_s), 0
        if bundles is not None and len(bundles) != num_actors:
            raise ValueError(
                f"judger {name!r}: {len(bundles)} placement bundles for {num_actors} actors"
            )
        self._placement_group, self._bundles = placement_group, list(bundles or [])
        self._options = {"num_cpus": cpus_per_actor}
        if memory_mb_per_actor > 0:
            self._options["memory"] = int(memory_mb_per_actor) * _MiB
        self._actor_class = ray.remote(JudgeActor)
        self._actors = [self._start(i) for i in range(num_actors)]
        self._started = [a.ready.remote() for a in self._actors]
        self._is_ready = False
        self._outstanding = [0] * num_actors
        self._turn = itertools.count()

    @property
    def actors(self) -> list:
        """The actor handles, slot by slot (a restart replaces one in place)."""
        return list(self._actors)

    @property
    def deadline_s(self) -> float:
        return 2 * self.timeout_s + self.restart_timeout_s + 5.0

    def _start(self, index: int):
        options = dict(self._options)
        pg, bundle = self._bundles[index] if self._bundles else (self._placement_group, -1)
        if pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            )
        return self._actor_class.options(**options).remote(
            self.name, self.fn_path, self.kwargs, self.timeout_s, index
        )

    async def ready(self) -> None:
        """Wait (up to restart_timeout_s) for the first actors to start; one that failed to start is
        handled like a dead one by the first item routed to it."""
        if self._is_ready:
            return
        done = await asyncio.wait_for(
            asyncio.gather(*self._started, return_exceptions=True), self.restart_timeout_s
        )
        if all(isinstance(d, BaseException) for d in done):
            raise JudgeError(f"none of its {len(done)} actors started: {first_line(done[0])}")
        self._is_ready = True

    def _pick(self) -> int:
        turn, n = next(self._turn), len(self._actors)
        return min(range(n), key=lambda i: (self._outstanding[i], (i - turn) % n))

    async def _call(self, index: int, actor, item: JudgeItem) -> Judgement:
        self._outstanding[index] += 1
        try:
            return await actor.judge.remote(item)
        finally:
            self._outstanding[index] -= 1

    async def _replace(self, index: int, dead) -> object:
        """The live actor of slot `index` after `dead` died: started here, or by a call that saw it first."""
        if self._actors[index] is dead:  # no await since the check: one replacement per death
            self._actors[index] = self._start(index)
            self.restarts += 1
            try:
                # it may be only unreachable; a half-alive copy must not keep its resources
                ray.kill(dead)
            except Exception:
                pass
        actor = self._actors[index]
        await asyncio.wait_for(actor.ready.remote(), self.restart_timeout_s)
        return actor

    async def _judge(self, item: JudgeItem) -> RawVerdict:
        index = self._pick()
        actor = self._actors[index]
        try:
            return await self._call(index, actor, item)
        except RayActorError as e:
            died = first_line(e)
        try:
            actor = await self._replace(index, actor)
        except Exception as e:
            why = "no answer" if isinstance(e, TimeoutError) else first_line(e)
            raise JudgeError(f"actor {index} died: {died}; its restart failed ({why})") from None
        try:
            return await self._call(index, actor, item)
        except RayActorError as e:
            raise JudgeError(
                f"actor {index} died: {died}; its restart died too: {first_line(e)}"
            ) from None

    def close(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone, or Ray shut down first
                pass
        self._actors = []

    def __repr__(self) -> str:
        return (
            f"RayJudger(name={self.name!r}, fn={self.fn_path!r}, num_actors={len(self._actors)}, "
            f"timeout_s={self.timeout_s:g})"
        )
