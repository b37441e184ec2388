"""EngineRouter: send each generation request to the engine with the fewest requests outstanding.

Engines are RolloutWorker Ray actor handles (threaded actors: many requests in flight each) or, in
tests, RolloutWorker objects in this process. Counts are this router's own (each agent-loop actor has
its router), ties go to the lowest index, so requests submitted together in a fixed order land on
engines deterministically.

    router = EngineRouter(engines, max_retries=2)
    sample = await router.generate(prompt_ids, dict(temperature=1.0, max_tokens=32, seed=7))
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

from rlmega.rollout.rollout import GENERATION_GROUP

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    """A request failed on every try; its group must be dropped, not trained on."""


async def generate_one(engine, *args, **kwargs):
    """Await ``engine.generate_one(*args, **kwargs)`` on a Ray actor handle (in the engine's generation
    concurrency group: rlmega/launch/roles.py ``engine_actor_class``) or on a local RolloutWorker (in a
    thread: it blocks until its request finishes)."""
    fn = engine.generate_one
    if hasattr(fn, "remote"):
        return await fn.options(concurrency_group=GENERATION_GROUP).remote(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class EngineRouter:
    def __init__(self, engines: list, max_retries: int = 2):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.outstanding = [0] * len(self.engines)
        self.max_retries = max_retries
        self.failures = 0  # failed tries (retried or not), for the metrics
        self._ids = itertools.count()
        # routers in several processes share the engines: ids stay unique
        self._prefix = uuid.uuid4().hex[:8]

    def _pick(self, avoid: int | None = None) -> int:
        order = sorted(range(len(self.engines)), key=lambda i: (i == avoid, self.outstanding[i], i))
        return order[0]

    async def generate(self, prompt_ids: list[int], sampling: dict):
        """One response (a rollout Sample) for ``prompt_ids``; GenerationFailed after the retries."""
        last_error, avoid = None, None
        for attempt in range(self.max_retries + 1):
            i = self._pick(avoid)
            self.outstanding[i] += 1
            try:
                sample = await generate_one(
                    self.engines[i],
                    list(prompt_ids),
                    request_id=f"{self._prefix}-{next(self._ids)}",
                    **sampling,
                )
            except Exception as e:  # an engine error or a dead engine: try another (the same seed)
                last_error, avoid = e, i
                self.failures += 1
                log.warning(
                    "generation on engine %d failed (try %d of %d): %r",
                    i,
                    attempt + 1,
                    self.max_retries + 1,
                    e,
                )
                continue
            finally:
                self.outstanding[i] -= 1
            if sample.finish_reason == "abort":
                last_error, avoid = RuntimeError("request aborted"), i
                self.failures += 1
                continue
            return sample
        raise GenerationFailed(f"generation failed {self.max_retries + 1} times: {last_error!r}")

    def load(self) -> list[int]:
        return list(self.outstanding)
