"""Start, use and release every role of a run on Ray: actor ranks, rollout engines, reward
workers and the coordinator.

    with Roles(cfg) as roles:                        # embedded local Ray, or attach to cluster.address
        groups = roles.rollout([("default", GroupRequest(...)), ...])   # agent loops: judged trajectories
        roles.train_phase()                          # engines sleep, trainer onloads (colocated GPUs)
        roles.call_policy(Actor.train_step, batch)
        roles.rollout_phase(version=1)               # trainer offloads, engines wake, weights sync

Where each rank and engine runs comes from rlmega.config.placement_plan (one placement group per node on
GPUs). Leaving the block (normally, by an error, or by Ctrl-C) kills every actor and engine, removes the
placement groups, stops the dashboard and shuts Ray down if this process started it. A dead engine
or rank surfaces as ``RoleDied`` naming it, within ``call_timeout_s`` at the latest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

import ray
from ray.util.placement_group import remove_placement_group

from rlmega.agents.hosting import AgentLoopHost, BackgroundLoop, Generation
from rlmega.agents.placement import run_cpus
from rlmega.config.placement_plan import placement_plan
from rlmega.config.schema import RLConfig
from rlmega.data.packing import mini_batch_count
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.launch import threads, torchrun_group
from rlmega.launch.agent_loops import start_agent_loops
from rlmega.launch.cluster import check_shared_paths, connect, node_names, place_groups
from rlmega.launch.engines import start_engines
from rlmega.launch.phases import ColocatedPhases
from rlmega.launch.sharded import ShardedCalls
from rlmega.launch.errors import WorkerFailed, first_failure, meet
from rlmega.launch.trainer_group import start_critic, start_trainer
from rlmega.launch.worker_group import WorkerGroup, WorkerGroupError
from rlmega.sync.collective import CollectiveTransport
from rlmega.sync.transports import CudaIpcTransport, RayTransport
from rlmega.launch.coordinator import ActorManager
from rlmega.learner.actor_api import Actor
from rlmega.learner.critic_api import Critic
from rlmega.rundir.startup import StartupClock

log = logging.getLogger("rlmega")
P = ParamSpec("P")
R = TypeVar("R")


def method_name(method: Callable, interface: type) -> str:
    """The name of ``method``, a method of ``interface`` (``Actor.train_step``). Callers name a rank's method
    through its interface: a misspelt one fails where it is written (and in a type check, which also checks its
    arguments against the interface's signature); a method of another interface is refused here, before
    anything is sent."""
    name = getattr(method, "__name__", "")
    if getattr(interface, name, None) is not method:
        raise TypeError(f"{method!r} is not a method of {interface.__name__}")
    return name


def of_actor(method: Callable) -> str:
    """``method_name(method, Actor)``: a policy rank's method, by the Actor interface's function."""
    return method_name(method, Actor)


def of_critic(method: Callable) -> str:
    """``method_name(method, Critic)``: a critic rank's method, by the Critic interface's function."""
    return method_name(method, Critic)


class RoleDied(WorkerFailed):
    """A worker of the run raised, died or hung: ``worker`` names it (see launch/errors.py)."""


class Roles:
    def __init__(
        self,
        cfg: RLConfig,
        call_timeout_s: float = 1800.0,
        pg_timeout_s: float = 120.0,
        clock: StartupClock | None = None,
        eval_requests: int | None = None,
    ):
        """``clock``: where the start-up's phases go (rlmega/rundir/startup.py; default: kept, not printed).
        ``eval_requests``: the run's eval prompts, which size a compiled engine's CUDA graphs (None: not known,
        vLLM's default sizes; rlmega/config/engine_mode.py)."""
        # Workers resolve a relative model.path from their own cwd: on another node that is not the driver's.
        cfg = dataclasses.replace(
            cfg,
            model=dataclasses.replace(
                cfg.model, path=os.path.abspath(cfg.model.path) if cfg.model.path else ""
            ),
        )
        self.cfg, self.call_timeout_s, self.pg_timeout_s = cfg, call_timeout_s, pg_timeout_s
        self.eval_requests = eval_requests
        self.clock = clock or StartupClock(echo=False)
        self.started_ray = False
        self.policy_ranks: WorkerGroup | None = None
        # the value model's ranks (algorithm.advantage_estimator=gae)
        self.critic_ranks: WorkerGroup | None = None
        # calls on a batch: planned once, one share per data-parallel rank (rlmega/launch/sharded.py)
        self.policy_calls: ShardedCalls | None = None
        self.critic_calls: ShardedCalls | None = None
        self.engines: list = []
        self.weight_transport = None  # made at the first sync (Roles._transport)
        # LoRA served unmerged (actor.lora, rollout.lora_merge false): syncs send the adapter alone, after one
        # sync of the trainer's base (a run resumed from a full-parameter checkpoint trains on other weights
        # than the engines' model.path)
        self.lora_unmerged = cfg.actor.lora.rank > 0 and not cfg.rollout.lora_merge
        self._base_sent = False
        self.hosts: dict[str, AgentLoopHost] = {}  # task name -> its agent loop (rlmega/agents/)
        self.background: BackgroundLoop | None = None
        self.manager: ActorManager | None = None
        self.pgs: list = []
        self.swaps = False  # the trainer releases its device memory while engines generate
        self.critic_swaps = False  # the critic does too
        # Async production generates while the trainer trains: the engines never sleep for it.
        self.keep_engines_awake = cfg.produce.strategy == "async"
        # who holds the devices (rlmega/launch/phases.py)
        self.phases: ColocatedPhases | None = None
        self._profile_name = ""  # the profile being recorded (logging.profile_steps)

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "Roles":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        c, p, r, clock = self.cfg.cluster, self.cfg.parallelism, self.cfg.rollout, self.clock
        self.started_ray = connect(c, run_cpus(self.cfg))
        clock.done("Ray")
        # Under torchrun the trainer ranks are its processes, not Ray actors: Ray places the engines
        # alone, on resources of their own (torchrun's ranks hold theirs outside Ray's view).
        on_torchrun = torchrun_group.rank() is not None
        critic_world = (self.cfg.critic.parallelism or p).world_size if self.has_critic else 0
        plan = (
            placement_plan(
                dataclasses.replace(p, world_size=0), r, dataclasses.replace(c, colocate=False)
            )
            if on_torchrun
            else placement_plan(p, r, c, critic_world=critic_world)
        )
        self.pgs, bundle_nodes = place_groups(plan, self.pg_timeout_s)
        engine_nodes = [bundle_nodes[s.group][s.bundles[0]] for s in plan.engines]
        rank_nodes = [bundle_nodes[s.group][s.bundles[0]] for s in plan.ranks]
        if not self.started_ray:  # an embedded Ray is this machine alone
            check_shared_paths(
                self.cfg.trainer.run_dir, self.cfg.model.path, rank_nodes, engine_nodes
            )
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 1) for n in ray.nodes() if n["Alive"]}
        # this machine: the embedded Ray may count more CPUs than it has, to fit the actors
        if self.started_ray:
            cpus = {n: min(v, len(os.sched_getaffinity(0))) for n, v in cpus.items()}
        rank_threads, engine_threads = threads.plan(
            self.cfg, rank_nodes, engine_nodes, cpus, on_torchrun, self.keep_engines_awake
        )
        self.manager = ActorManager(
            dashboard=True,
            host=self.cfg.logging.dashboard_host,
            port=self.cfg.logging.dashboard_port,
        )
        clock.listeners.append(self.manager.set_startup)
        # Engines, trainer ranks and critic start at once, each in its own processes, and meet here before
        # the first weight sync: the engines load vLLM and the model while the ranks build theirs. They begin
        # where placement ends (its recorded end: clock.now() here was a few ms later, after the dashboard's
        # update, and the two differed in their third decimal in one CI run).
        began = clock.done("placement")["end_s"]
        self.engines = start_engines(
            self.cfg,
            self.pgs,
            plan.engines,
            engine_threads,
            self._engine_profile_dir(),
            self.eval_requests,
        )
        meeting = {
            "engines": (
                [e.kv_cache_max_concurrency.remote() for e in self.engines],
                [f"rollout engine {i}" for i in range(len(self.engines))],
            )
        }
        # Colocated on GPUs the trainer gives the device up while the engines generate (None: decide so).
        offload = self.cfg.actor.offload_while_generating
        self.swaps = (c.colocate and r.device == "cuda") if offload is None else offload
        with_reference = self.cfg.algorithm.kl_coef > 0
        self.policy_ranks = start_trainer(
            self.cfg,
            plan,
            self.pgs,
            rank_threads,
            self.swaps,
            on_torchrun,
            self.optimizer_steps_per_rl_step(),
            self.call_timeout_s,
            wait=False,
        )
        log.info(
            "placement: trainer ranks on nodes %s; rollout engines on nodes %s",
            _by_node(node_names(self.policy_ranks.node_ids)) if not on_torchrun else "(torchrun's)",
            _by_node(node_names(engine_nodes)),
        )
        trainer = "trainer (policy" + (" + reference)" if with_reference else ")")
        # torchrun's ranks answer one blocking call at a time; the engines load meanwhile
        if on_torchrun:
            self.policy_ranks.call(of_actor(Actor.setup), with_reference=with_reference)
            clock.done(trainer, began)
        else:  # a rank runs its calls in the order they were made: setup once the build is done
            names = self.policy_ranks.names()
            setup = self.policy_ranks.submit(of_actor(Actor.setup), with_reference=with_reference)
            meeting[trainer] = (self.policy_ranks.starting + setup, names + names)
        if self.has_critic:
            offload = self.cfg.critic.offload_while_generating
            self.critic_swaps = (c.colocate and r.device == "cuda") if offload is None else offload
            self.critic_ranks = start_critic(
                self.cfg,
                plan,
                self.pgs,
                rank_threads,
                self.critic_swaps,
                self.optimizer_steps_per_rl_step(),
                self.call_timeout_s,
                wait=False,
            )
            names = self.critic_ranks.names()
            setup = self.critic_ranks.submit(of_critic(Critic.setup))
            meeting["critic"] = (self.critic_ranks.starting + setup, names + names)
        try:
            met = meet(meeting, self.call_timeout_s, done=lambda phase: clock.done(phase, began))
        except WorkerFailed as e:
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e
        except ray.exceptions.GetTimeoutError as e:
            raise RoleDied(
                f"the trainer ranks and engines did not all start within {self.call_timeout_s:.0f}s",
                "start-up",
            ) from e
        self.policy_calls = ShardedCalls(
            self.policy_ranks, self.policy_ranks.call(of_actor(Actor.data_layout))
        )
        if self.has_critic:
            self.critic_calls = ShardedCalls(
                self.critic_ranks, self.critic_ranks.call(of_critic(Critic.data_layout))
            )
        for i, value in enumerate(met["engines"]):
            self.manager.set_kv_cache_max_concurrency(i, value)
        # What the models compute with, as vLLM's processes report it (threads per model worker)
        log.info(
            "engine model threads: %s",
            self._get([e.engine_threads.remote() for e in self.engines], "rollout engine"),
        )
        self.phases = ColocatedPhases(
            engines=lambda method: self._get(
                [getattr(e, method).remote() for e in self.engines], "rollout engine"
            ),
            # the policy's calls without the phase check call_policy makes (these calls are the phases)
            trainer=lambda method, *args, **kwargs: self._call_policy(
                of_actor(method), *args, **kwargs
            ),
            critic=(
                lambda method, *args, **kwargs: self._submit_critic(
                    of_critic(method), args, kwargs
                )()
            )
            if self.critic_ranks is not None
            else None,
            swaps=self.swaps,
            critic_swaps=self.critic_swaps,
            keep_engines_awake=self.keep_engines_awake,
        )
        self.hosts, self.background, agents_pg = start_agent_loops(
            self.cfg, self.engines, self.pg_timeout_s
        )
        if agents_pg is not None:
            self.pgs.append(agents_pg)

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
        self.hosts = {}
        if self.background is not None:
            self.background.close()
            self.background = None
        for handle in self.engines:
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
        self.engines, self.weight_transport = [], None
        for group in (self.policy_ranks, self.critic_ranks):
            if group is not None:
                try:
                    group.shutdown()
                except Exception:
                    pass
        self.policy_ranks = self.critic_ranks = None
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.pgs = []
        if self.manager is not None:
            self.manager.cleanup()
            self.manager = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

    # ---- calls ------------------------------------------------------------------------------
    def optimizer_steps_per_rl_step(self) -> int:
        """Optimizer steps a full RL step takes (the LR schedule's unit); rlmega.step splits a short
        batch into fewer (the same function, on the batch's size) and moves the schedule on by the rest."""
        t = self.cfg.trainer
        return mini_batch_count(t.prompts_per_step * self.cfg.rollout.n, t.global_batch_size)

    def _get(self, refs: list, what: str, names: list[str] | None = None) -> list:
        """Results of calls on ``what`` workers (names[i] for refs[i], default "<what> i")."""
        try:
            return first_failure(
                refs, names or [f"{what} {i}" for i in range(len(refs))], self.call_timeout_s
            )
        except WorkerFailed as e:
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e
        except ray.exceptions.GetTimeoutError as e:
            raise RoleDied(
                f"a {what} did not answer within {self.call_timeout_s:.0f}s", what
            ) from e

    def call_policy(
        self, method: Callable[Concatenate[Actor, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method`` (a method of the Actor interface, ``Actor.train_step``) on every trainer rank: rank 0's
        result (every rank returns the same); a call on a RolloutBatch goes as one share per data-parallel rank
        and comes back merged (rlmega/launch/sharded.py). Brings a released trainer back first."""
        self.phases.before_training()
        return self._call_policy(method_name(method, Actor), *args, **kwargs)

    def _call_policy(self, method: str, *args, **kwargs):
        try:
            # planned here once, each rank only its share
            if args and isinstance(args[0], RolloutBatch):
                return self.policy_calls.submit(method, *args, **kwargs)()
            return self.policy_ranks.call_rank0(method, *args, **kwargs)
        except WorkerGroupError as e:
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e

    @property
    def has_critic(self) -> bool:
        """The run trains a value model (algorithm.advantage_estimator=gae)."""
        return self.cfg.algorithm.advantage_estimator == "gae"

    def call_critic(
        self, method: Callable[Concatenate[Critic, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method`` (of the Critic interface) on every critic rank: rank 0's result (every rank returns the
        same)."""
        return self.submit_critic(method, *args, **kwargs)()

    def submit_critic(
        self, method: Callable[Concatenate[Critic, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Callable[[], R]:
        """A critic call (``method`` of the Critic interface) started now; returns a function that waits for it
        and gives rank 0's result, so the actor's ranks can work meanwhile (the value forward beside the
        log-probs, the critic's train step beside the policy's). Brings a released trainer and critic back first,
        as call_policy does: a critic offloaded while the engines generate (critic.offload_while_generating)
        was saved offloaded at a checkpoint before (the first save of a colocated PPO run failed)."""
        if self.critic_ranks is None:
            raise RuntimeError("this run has no critic (algorithm.advantage_estimator is not gae)")
        self.phases.before_training()
        return self._submit_critic(method_name(method, Critic), tuple(args), dict(kwargs))

    def _submit_critic(
        self, name: str, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]
    ) -> Callable[[], Any]:
        """submit_critic without the phase check (the phases' own calls)."""
        try:
            if call_args and isinstance(call_args[0], RolloutBatch):
                wait = self.critic_calls.submit(name, *call_args, **call_kwargs)
            else:
                wait = self.critic_ranks.submit_rank0(name, *call_args, **call_kwargs)
        except WorkerGroupError as e:
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e

        def result():
            try:
                return wait()
            except WorkerGroupError as e:
                raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e

        return result

    def rollout(self, requests: list) -> list:
        """Judged trajectory groups for ``requests`` [(task name, GroupRequest)], in request order: every
        group is in flight at once, each through its task's agent loop (rlmega/agents/)."""
        import asyncio

        self.phases.before_generation()

        async def run_all():
            return await asyncio.gather(
                *[self.hosts[task].run_group(req) for task, req in requests]
            )

        return self.background.run(run_all(), timeout=self.call_timeout_s)

    def engine_busy_seconds(self) -> float:
        """Seconds the engines have had requests in flight, summed over engines (busy fractions)."""
        return sum(self._get([e.busy_seconds.remote() for e in self.engines], "rollout engine"))

    def generation_failures(self) -> int:
        """Failed generation tries so far (retried or, after the retries, their group dropped)."""
        return sum(h.generation_failures() for h in self.hosts.values())

    def sync_weights(
        self, version: int, bucket_bytes: int = 512 << 20, in_flight: str | None = None
    ) -> dict:
        """Stream the trainer's weights into every engine (both must be resident: see rollout_phase).

        ``in_flight``: None, for a sync between rollouts (no request in flight, or they take the
        new weights as they come); "finish" or "abort", for requests in flight: every engine is paused
        first (``RolloutWorker.pause_generation``: new requests wait; "finish" lets the ones in flight
        end on the old weights, "abort" cuts them to resume on the new ones) and resumed after, also
        when the sync fails. Returns bytes, seconds and, with ``in_flight``, "preempted": how many
        requests the engines cut ("abort") or let finish ("finish") for it.
        """
        if in_flight not in (None, "finish", "abort"):
            raise ValueError(f"in_flight={in_flight!r}: choose None, 'finish' or 'abort'")
        self.phases.before_sync()
        if in_flight is None:
            return self._send_weights(version, bucket_bytes)
        failed = True
        try:  # pausing inside: engines paused before one of them failed are resumed too
            preempted = sum(
                self._get(
                    [e.pause_generation.remote(in_flight == "abort") for e in self.engines],
                    "rollout engine",
                )
            )
            sent = self._send_weights(version, bucket_bytes)
            failed = False
        finally:
            try:
                self._get([e.resume_generation.remote() for e in self.engines], "rollout engine")
            except Exception:
                if not failed:
                    raise
                log.warning(
                    "resuming the engines after a failed weight sync failed too", exc_info=True
                )
        return {**sent, "preempted": preempted}

    def _transport(self):
        """rollout.weight_transport's transport to the engines, made once: a CollectiveTransport's trainer
        ranks keep their process groups with the engines across syncs by its key."""
        if self.weight_transport is None:
            kind = {"collective": CollectiveTransport, "cuda_ipc": CudaIpcTransport}.get(
                self.cfg.rollout.weight_transport, RayTransport
            )
            self.weight_transport = kind(self.engines, self.call_timeout_s)
        return self.weight_transport

    def _send_weights(self, version: int, bucket_bytes: int) -> dict:
        if self.lora_unmerged and self._base_sent:
            return self._send_adapter(version)
        try:
            sent = self.policy_ranks.call(
                of_actor(Actor.sync_model_to_rollout),
                self._transport(),
                version,
                bucket_bytes,
                "base" if self.lora_unmerged else "merged",
            )
        except WorkerGroupError as e:
            dead = self._dead_engines()
            if dead:  # the ranks failed because an engine they were sending to is gone
                names = ", ".join(f"rollout engine {i}" for i in dead)
                raise RoleDied(f"{names} died during the weight sync", names) from e
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e
        out = {"bytes": sum(s["bytes"] for s in sent), "seconds": max(s["seconds"] for s in sent)}
        if not self.lora_unmerged:
            self._check_versions(version)
            return out
        self._base_sent = True  # the base in, now the adapters on it
        adapter = self._send_adapter(version)
        return {
            "bytes": out["bytes"] + adapter["bytes"],
            "seconds": out["seconds"] + adapter["seconds"],
        }

    def _send_adapter(self, version: int) -> dict:
        """The policy's LoRA adapter to every engine (RolloutWorker.load_adapter): a few megabytes, put into
        Ray's object store once by trainer rank 0, read from there by each engine (not through the driver)."""
        start = time.perf_counter()
        try:
            put = next(
                f
                for f in self.policy_ranks.call(of_actor(Actor.put_adapter_for_rollout))
                if f is not None
            )
        except WorkerGroupError as e:
            raise RoleDied(str(e), e.worker, e.cause, e.remote_traceback) from e
        self._get(
            [e.load_adapter.remote(put["ref"], version) for e in self.engines], "rollout engine"
        )
        self._check_versions(version)
        return {"bytes": put["bytes"], "seconds": time.perf_counter() - start}

    def _check_versions(self, version: int) -> None:
        versions = self._get([e.weight_version.remote() for e in self.engines], "rollout engine")
        if versions != [version] * len(self.engines):
            raise RuntimeError(f"engines hold weight versions {versions}, expected {version}")

    # ---- colocated phases (GPU: engines and trainer take turns on the same devices) ---------
    def train_phase(self) -> None:
        """Engines free their GPU memory, the trainer takes its parameters and state back (phases.py)."""
        self.phases.train_phase()

    def rollout_phase(self, version: int, in_flight: str | None = None) -> dict:
        """After training: release the trainer, wake the engines and send them the new weights
        (``in_flight``: what happens to requests in flight, see sync_weights)."""
        return self.phases.rollout_phase(lambda: self.sync_weights(version, in_flight=in_flight))

    def generation(self) -> "Generation":
        """What the producer (rlmega/agents/produce.py) generates through: no more of Roles than that."""
        return Generation(
            hosts=self.hosts,
            loop=self.background.loop,
            prompts=self.manager.prompts,
            results=self.manager.results,
            should_stop=self.manager.should_stop,
            sync=self.rollout_phase,
            rollout=self.rollout,
            failures=self.generation_failures,
            timeout_s=self.call_timeout_s,
        )

    # ---- profiling (logging.profile_steps, rlmega/rundir/profiling.py) --------------------------------
    def _engine_profile_dir(self) -> str | None:
        """Where engines write traces (fixed when they start; stop_profile files them by step)."""
        if not self.cfg.logging.profile_steps:
            return None
        return str(Path(self.cfg.trainer.run_dir).resolve() / "profile" / "engines")

    def start_profile(self, name: str) -> None:
        self._call_policy(of_actor(Actor.start_profile))
        self._get(
            [e.start_profile.remote(f"{name}_engine{i}") for i, e in enumerate(self.engines)],
            "rollout engine",
        )
        self._profile_name = name

    def stop_profile(self, out_dir: str) -> list[str]:
        """Every rank's and engine's trace of this profile, in ``out_dir``; returns their paths."""
        paths = self.policy_ranks.call(of_actor(Actor.stop_profile), out_dir)
        self._get([e.stop_profile.remote() for e in self.engines], "rollout engine")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for f in sorted(Path(self._engine_profile_dir()).glob(f"{self._profile_name}_engine*")):
            paths.append(
                str(f.replace(Path(out_dir) / f.name.removeprefix(f"{self._profile_name}_")))
            )
        return paths

    def _dead_engines(self) -> list[int]:
        dead = []
        for i, engine in enumerate(self.engines):
            try:
                ray.get(engine.weight_version.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead


def _by_node(names: list[str]) -> str:
    """'node-a: 0 1, node-b: 2 3' for the node name of each worker index."""
    out: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        out.setdefault(name, []).append(str(i))
    return ", ".join(f"{name}: {' '.join(ix)}" for name, ix in out.items())
