"""The producer: makes the trainer's batches through the agent loops, synchronously or asynchronously
(produce.strategy), with DAPO's dynamic sampling (algorithm.dynamic_sampling).

    with Producer(roles.generation(), data, cfg.produce, cfg.algorithm, cfg.trainer, cfg.rollout,
                  start=step, state=extra.get("producer")) as producer:  # close()s
        producer.advance(step)              # the engines hold weights `step`: batches up to step + k may start
        batch = producer.take(step)         # batch `step`, the one RL step `step` trains on (waits for it)
        ... log-probs, train ...
        producer.sync(step + 1)             # the new weights into the engines, as the schedule allows
        producer.pause(); producer.state_dict()  # at a checkpoint: nothing in production, the buffer as data
        producer.advance(step + 1)

One coroutine on the agent loops' event loop makes batch after batch (its groups all in flight at once)
into the coordinator's result queue. Batch b may start once the engines hold weights version >= b - k:
    sync   k = 0: batch b starts after the weights of step b are synced, so generation and training take
           turns (the numbers of the serial loop this replaced, to the digit);
    async  k = produce.max_staleness: batches run up to k ahead while the trainer trains. Every token
           records the version it was sampled with; a trajectory's staleness at step s is s - the version of
           its oldest token, <= k by this rule. A group found staler when taken (a resume with a smaller k)
           is dropped or generated again (produce.on_stale).
Deterministic schedule (sync, or async with produce.deterministic): the sync to version u first waits for
every batch generated with an older version (b <= u - 1 + k), so batch b is generated entirely with
version max(0, b - k) and no request is in flight at a sync; with the same seeds every run samples the
same tokens. Otherwise (async, the fast mode) a sync never waits for production: requests in flight
finish on the old weights or are preempted and resumed on the new ones (produce.in_flight), and a batch
takes whatever version the engines hold when it starts (>= b - k, decided by timing).

Seeds: group i of batch b samples with rollout.seed + b * 1_000_003 + i * n + j (j: its sample), the
seeds of the serial loop; a dynamic-sampling refill continues i past the first round's groups.

Checkpoints (``pause`` then ``state_dict``): the next batch to make and every finished batch not yet
trained on, as plain data; the prompt sampler's position (Tasks.state_dict) is the producer's, so the
prompts of buffered batches are never drawn twice. A resumed deterministic run then makes and trains on
exactly the batches of an uninterrupted one. In the fast mode a resume loses and repeats nothing and
keeps the staleness bound, but which version a batch gets depends on timing in both runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from rlmega.agents.buffer import ProducedBatch
from rlmega.agents.hosting import Generation
from rlmega.agents.tasks import Tasks
from rlmega.agents.loop import GroupRequest
from rlmega.agents.trajectory import TrajectoryGroup, staleness
from rlmega.algorithms.dapo import is_uniform
from rlmega.config.schema import AlgorithmConfig, ProduceConfig, RolloutConfig, TrainerConfig

log = logging.getLogger("rlmega")

SEED_STRIDE = 1_000_003  # per-batch engine seeds: far apart, reproducible on resume
_POLL_S = 0.5  # how often a waiting producer or trainer looks at the stop flag


def sample_seed(base: int, step: int) -> int:
    return base + step * SEED_STRIDE


def group_requests(
    picked: list, n: int, base_seed: int | None, sampling: dict | None = None, offset: int = 0
) -> list:
    """[(task, GroupRequest)] for prompts [(task, Prompt)]; request i has group id offset + i and samples
    with seeds base_seed + (offset + i) * n + j."""
    return [
        (
            task,
            GroupRequest(
                prompt_index=offset + i,
                prompt_ids=p.request_ids(),
                label=p.label,
                prompt_text=p.text,
                n=n,
                sampling=sampling,
                seed=None if base_seed is None else base_seed + (offset + i) * n,
                images=tuple(p.images),
                scored_ids=list(p.token_ids) if p.images else None,
                columns=dict(p.columns),
            ),
        )
        for i, (task, p) in enumerate(picked)
    ]


class ProductionStalled(RuntimeError):
    """The trainer waited longer than the call timeout for a batch."""


class Producer:
    def __init__(
        self,
        gen: Generation,
        data: Tasks,
        produce: ProduceConfig,
        algorithm: AlgorithmConfig,
        trainer: TrainerConfig,
        rollout: RolloutConfig,
        start: int,
        state: dict | None = None,
    ):
        """``gen``: what it generates through (rlmega.agents.hosting.Generation: hosts, queues, the stop flag,
        the weight sync); ``data``: the tasks' prompts; ``produce``: sync or async and its bounds; ``algorithm``:
        dynamic sampling; ``trainer``: steps and prompts per step; ``rollout``: samples per prompt and the seed;
        ``start``: the first step's batch; ``state``: a checkpoint's (state_dict)."""
        pr = produce
        self.gen, self.data, self.algorithm, self.rollout = gen, data, algorithm, rollout
        self.prompts_per_step = trainer.prompts_per_step
        self.sync_mode = pr.strategy == "sync"
        self.k = 0 if self.sync_mode else pr.max_staleness
        self.deterministic = self.sync_mode or pr.deterministic
        # sync trains on the newest weights by definition: a buffered batch (an async checkpoint) is redone
        self.on_stale = "requeue" if self.sync_mode else pr.on_stale
        self.in_flight = None if self.sync_mode else pr.in_flight
        self.timeout_s = gen.timeout_s
        self.end = trainer.total_steps  # no batch past the last step
        self.prompts, self.results = gen.prompts, gen.results  # hosted by the coordinator
        self._cond = threading.Condition()
        self._next, self._allowed, self._producing = start, None, None
        self._hold, self._closing, self._stopped, self._error = True, False, False, None
        for s in (state or {}).get("buffer", []):
            if s["index"] >= start:
                self.results.put(ProducedBatch.from_state(s))
        if state:
            self._next = max(start, state["next_batch"])
        self._loop = gen.loop
        self._wake = asyncio.Event()
        self._future = asyncio.run_coroutine_threadsafe(self._main(), self._loop)

    # ---- the trainer's side (driver thread) -------------------------------------------------
    def advance(self, version: int) -> None:
        """The engines hold weights ``version``: let batches b <= version + k start."""
        with self._cond:
            self._allowed, self._hold = version, False
        self._poke()

    def take(self, step: int) -> ProducedBatch | None:
        """Batch ``step`` (waits for it), stale groups handled; None if production stopped on should_stop."""
        start = time.perf_counter()
        with self._cond:
            while (batch := self.results.get(step)) is None:
                self._raise_if_failed()
                if self._stopped and self._producing is None:
                    return None
                if self._hold and self._producing is None:
                    raise RuntimeError(
                        f"batch {step} taken while production is paused (advance() first)"
                    )
                if time.perf_counter() - start > self.timeout_s:
                    raise ProductionStalled(
                        f"batch {step} did not arrive within {self.timeout_s:.0f}s "
                        f"(producing batch {self._producing}); see the engine logs"
                    )
                self._cond.wait(_POLL_S)
        return self._handle_stale(batch, step)

    def sync(self, version: int) -> dict:
        """Weights ``version`` into the engines. Deterministic schedule: first wait for every batch that
        the older weights generate (b <= version - 1 + k)."""
        if self.deterministic and self.k:
            last = min(version - 1 + self.k, self.end - 1)  # no batch is made past the last step
            self._wait(
                lambda: self._next > last or self._stopped,
                f"batch {last} before the sync to {version}",
            )
        sent = self.gen.sync(version, in_flight=self.in_flight)
        # time_weight_transfer: the transfer alone (the slowest sender's), inside time_sync's release and wake
        return {
            "preempted_requests": sent.get("preempted", 0),
            "sync_bytes": sent["bytes"],
            "time_weight_transfer": sent["seconds"],
        }

    def pause(self) -> None:
        """Start no batch until ``advance``, and wait for the one in production (a checkpoint's state)."""
        with self._cond:
            self._hold = True
        self._wait(lambda: self._producing is None, "the batch in production to finish")

    def state_dict(self) -> dict:
        """After ``pause``: the next batch to make and the finished batches not yet trained on."""
        with self._cond:
            return {
                "next_batch": self._next,
                "buffer": [b.to_state() for b in self.results.batches()],
            }

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closing = True
        self._poke()
        self._future.cancel()  # a batch in flight: its requests go with the engines

    def _wait(self, predicate, what: str) -> None:
        start = time.perf_counter()
        with self._cond:
            while not predicate():
                self._raise_if_failed()
                if time.perf_counter() - start > self.timeout_s:
                    raise ProductionStalled(f"waited {self.timeout_s:.0f}s for {what}")
                self._cond.wait(_POLL_S)
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _poke(self) -> None:
        self._loop.call_soon_threadsafe(self._wake.set)

    def _handle_stale(self, batch: ProducedBatch, step: int) -> ProducedBatch:
        stale = stale_groups(batch, step, self.k)
        batch.stats.update(stale_dropped=0, stale_requeued=0)
        if not stale:
            return batch
        if self.on_stale == "requeue":  # generated again now, with the weights the trainer holds
            redone = self.gen.rollout([batch.requests[i] for i in stale])
            for i, g in zip(stale, redone):
                batch.groups[i] = g
            batch.stats["stale_requeued"] = len(stale)
        else:
            drop_groups(batch, stale, self.k)
        log.warning(
            "batch %d: %d group(s) older than max_staleness %d %s",
            step,
            len(stale),
            self.k,
            "generated again" if self.on_stale == "requeue" else "dropped",
        )
        return batch

    # ---- the producing side (the agent loops' event loop) -----------------------------------
    async def _main(self) -> None:
        try:
            while (b := await self._next_to_start()) is not None:
                batch = await self._produce(b)
                self.results.put(batch)
                with self._cond:
                    self._producing, self._next = None, b + 1
                    self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the trainer raises it from take/sync/pause
            with self._cond:
                self._error, self._producing = e, None
                self._cond.notify_all()

    async def _next_to_start(self) -> int | None:
        """The next batch once the schedule lets it start; None when closing or the run should stop."""
        while True:
            self._wake.clear()
            with self._cond:
                if self._closing:
                    return None
                if self.gen.should_stop():  # the coordinator's flag, polled by the producer
                    self._stopped = True
                    self._cond.notify_all()
                    return None
                b = self._next
                if (
                    b < self.end
                    and not self._hold
                    and self._allowed is not None
                    and b - self.k <= self._allowed
                ):
                    self._producing = b
                    return b
            try:
                await asyncio.wait_for(self._wake.wait(), _POLL_S)
            except asyncio.TimeoutError:
                pass

    async def _produce(self, b: int) -> ProducedBatch:
        """Batch b: one step's prompts; with dynamic sampling, more rounds until prompts_per_step groups
        with differing rewards (or max_sampling_rounds)."""
        alg = self.algorithm
        want, n, base = self.prompts_per_step, self.rollout.n, sample_seed(self.rollout.seed, b)
        start = time.perf_counter()
        failures = await asyncio.to_thread(self.gen.failures)
        kept: list[tuple[tuple[str, GroupRequest], TrajectoryGroup]] = []
        drawn = rounds = filtered = 0
        while True:
            # the tasks' mix
            requests = group_requests(self.data.next_prompts(), n, base, offset=drawn)
            drawn, rounds = drawn + len(requests), rounds + 1
            for req, g in zip(requests, await self._run(b, requests)):
                if (
                    alg.dynamic_sampling
                    and g.error is None
                    and is_uniform([t.reward for t in g.trajectories])
                ):
                    filtered += 1  # all rewards equal: GRPO advantages 0, nothing to learn from
                else:
                    kept.append((req, g))
            if (
                not alg.dynamic_sampling
                or _valid(kept) >= want
                or rounds >= alg.max_sampling_rounds
            ):
                break
        # the first `want` good groups in draw order (failed ones met on the way stay: counted)
        if alg.dynamic_sampling:
            valid, cut = 0, len(kept)
            for i, (_, g) in enumerate(kept):
                valid += g.error is None
                if valid == want:
                    cut = i + 1
                    break
            kept = kept[:cut]
        for i, ((_, req), g) in enumerate(kept):  # group ids 0.. in the batch
            req.prompt_index = g.prompt_index = i
        stats = {
            "time_generate": time.perf_counter() - start,
            "sampling_rounds": rounds,
            "prompts_drawn": drawn,
            "groups_filtered": filtered,
            "groups_short": max(0, want - _valid(kept)),
            "generation_failures": await asyncio.to_thread(self.gen.failures) - failures,
        }
        return ProducedBatch(
            index=b, groups=[g for _, g in kept], requests=[r for r, _ in kept], stats=stats
        )

    async def _run(self, b: int, requests: list) -> list[TrajectoryGroup]:
        self.prompts.add(b, len(requests))

        async def one(task: str, req: GroupRequest) -> TrajectoryGroup:
            try:
                return await self.gen.hosts[task].run_group(req)
            finally:
                self.prompts.done(b)

        return await asyncio.gather(*[one(task, req) for task, req in requests])


def stale_groups(batch: ProducedBatch, step: int, k: int) -> list[int]:
    """Indices of the batch's groups with a trajectory more than ``k`` versions behind the trainer at ``step``."""
    return [
        i
        for i, g in enumerate(batch.groups)
        if g.error is None and any(staleness(t, step) > k for t in g.trajectories)
    ]


def drop_groups(batch: ProducedBatch, indices: list[int], k: int) -> None:
    """produce.on_stale=drop: remove those groups (and their requests) in place, counted in the stats; a
    batch left with no group cannot train: an error saying what to do."""
    out = set(indices)
    keep = [i for i in range(len(batch.groups)) if i not in out]
    batch.groups = [batch.groups[i] for i in keep]
    batch.requests = [batch.requests[i] for i in keep]
    batch.stats["stale_dropped"] = len(out)
    if not batch.groups:
        raise RuntimeError(
            f"batch {batch.index}: every group is older than produce.max_staleness={k} (a checkpoint "
            "of a run with a larger k?). Fix: produce.on_stale=requeue generates them again with the "
            "current weights"
        )


def _valid(kept: list) -> int:
    return sum(g.error is None for _, g in kept)
