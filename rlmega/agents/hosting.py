"""Where an agent loop runs: in the driver's process (num_ray_actors 0), in one Ray actor (1), or in
N actors behind a least-loaded router (N > 1). Callers use ``AgentLoopHost.run_group`` either way;
an actor is reached through its methods only.

    host = AgentLoopHost(spec, engines, bundles)     # bundles: (placement group, index) per actor
    group = await host.run_group(GroupRequest(...))   # on the host's event loop (BackgroundLoop)

``LoopSpec`` is everything a process needs to build the loop (it travels to the actors): the task's
agent-loop config with its judgers, the reward section (the default judger), the model path (the
tokenizer), sampling defaults and the group size.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable

from rlmega.agents.loop import AgentLoop, GroupRequest, make_agent_loop
from rlmega.agents.router import EngineRouter
from rlmega.agents.trajectory import TrajectoryGroup


@dataclasses.dataclass
class LoopSpec:
    task: str
    agent_loop: Any  # AgentLoopConfig
    reward: Any  # RewardConfig: the default judger
    model_path: str
    sampling: dict
    n: int
    judger_bundles: list = dataclasses.field(default_factory=list)
    """(placement group, bundle index) for each Ray actor the judgers start (rlmega.judgers)."""


def build_loop(spec: LoopSpec, engines: list) -> AgentLoop:
    """The agent loop of ``spec`` in this process, its judgers built (and their actors started) here."""
    from transformers import AutoTokenizer

    from rlmega.data.images import load_processor
    from rlmega.judgers.factory import build_judger

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    judger = build_judger(spec.agent_loop.judgers, spec.reward, bundles=spec.judger_bundles)
    router = EngineRouter(engines, spec.agent_loop.max_generation_retries)
    return make_agent_loop(
        spec.task,
        spec.agent_loop,
        router,
        judger,
        tokenizer,
        spec.sampling,
        spec.n,
        load_processor(spec.model_path),
    )


class AgentLoopActor:
    """An agent loop in a Ray actor (async: many groups in flight at once)."""

    def __init__(self, spec: LoopSpec, engines: list):
        self.loop = build_loop(spec, engines)

    async def run_group(self, req: GroupRequest) -> TrajectoryGroup:
        return await self.loop.run_group(req)

    def generation_failures(self) -> int:
        return self.loop.router.failures

    def close(self) -> None:
        self.loop.judger.close()


class AgentLoopHost:
    def __init__(
        self,
        spec: LoopSpec,
        engines: list,
        bundles: list | None = None,
        judger_bundles: list[list] | None = None,
    ):
        """``bundles``: (placement group, index) for each of the spec's num_ray_actors actors;
        ``judger_bundles``: for each loop instance (the local one, or each actor), its judgers' bundles."""
        self.spec, self.local, self.actors = spec, None, []
        n = spec.agent_loop.num_ray_actors
        judger_bundles = judger_bundles or [[] for _ in range(max(1, n))]
        if n == 0:
            self.local = build_loop(
                dataclasses.replace(spec, judger_bundles=judger_bundles[0]), engines
            )
        else:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            cfg, Actor = spec.agent_loop, ray.remote(AgentLoopActor)
            for i in range(n):
                opts: dict = dict(num_cpus=cfg.cpus_per_actor, max_concurrency=1024)
                if cfg.memory_mb_per_actor:
                    opts["memory"] = cfg.memory_mb_per_actor * 2**20
                if bundles:
                    pg, index = bundles[i]
                    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index
                    )
                self.actors.append(
                    Actor.options(**opts).remote(
                        dataclasses.replace(spec, judger_bundles=judger_bundles[i]), engines
                    )
                )
        self.outstanding = [0] * len(self.actors)

    async def run_group(self, req: GroupRequest) -> TrajectoryGroup:
        if self.local is not None:
            return await self.local.run_group(req)
        i = min(range(len(self.actors)), key=lambda k: (self.outstanding[k], k))  # least loaded
        self.outstanding[i] += 1
        try:
            return await self.actors[i].run_group.remote(req)
        except Exception as e:  # the actor died: the group is lost, named, never a zero-reward row
            return TrajectoryGroup(
                task=self.spec.task,
                prompt_index=req.prompt_index,
                label=req.label,
                error=f"agent-loop actor {i} of task {self.spec.task!r} failed: {e!r}",
            )
        finally:
            self.outstanding[i] -= 1

    def generation_failures(self) -> int:
        if self.local is not None:
            return self.local.router.failures
        import ray

        return sum(ray.get([a.generation_failures.remote() for a in self.actors]))

    def close(self) -> None:
        if self.local is not None:
            self.local.judger.close()
        for a in self.actors:
            try:
                import ray

                ray.get(a.close.remote(), timeout=30)
                ray.kill(a)
            except Exception:  # already dead
                pass
        self.actors = []


class BackgroundLoop:
    """An asyncio event loop in a daemon thread: the driver is synchronous, the agent loops are not,
    and objects bound to a loop (HTTP clients, tasks) must keep the same one across steps."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="agent-loops", daemon=True
        )
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, drain_s: float = 5.0) -> None:
        """Cancel the loop's tasks and let them unwind (``drain_s`` at most), then stop it: asyncio.run's own
        shutdown. A loop stopped with tasks pending logged "Task was destroyed but it is pending!" for each
        when they were collected (issue 56: a producer's batch in flight, its requests' waits)."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=drain_s)

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(drain_s + 1)
            # a task that ignores cancelling: left
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


@dataclasses.dataclass
class Generation:
    """What the producer (rlmega/agents/produce.py) generates through, and no more: the agent loops' hosts by
    task and the event loop they run on, the coordinator's prompt and result queues and its stop flag, and
    three calls into the roles: ``sync(version, in_flight=...)`` the new weights into the engines (the
    colocated rollout phase), ``rollout(requests)`` groups outside the schedule (a stale group again, with
    the engines given the devices first), ``failures()`` generation tries failed so far.
    rlmega.launch.roles.Roles.generation() makes it."""

    hosts: dict
    loop: asyncio.AbstractEventLoop
    prompts: Any
    results: Any
    should_stop: Callable[[], bool]
    sync: Callable[..., dict]
    rollout: Callable[[list], list]
    failures: Callable[[], int]
    timeout_s: float
