"""A group of Ray actors that form one torch.distributed world: one rank each.

    ray.init(...)                                    # rlmega.launch.roles does this
    group = WorkerGroup(MegatronActor, world_size=4, kwargs={...}, num_cpus=0.5)
    group.call("setup")                              # same call on every rank, results in rank order
    lp = group.call("compute_logprobs", batch)[0]    # every rank returns the same full result

Rank 0's node address (127.0.0.1 when every rank is on its node) and a free port on it become
MASTER_ADDR/MASTER_PORT; each actor gets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE before the worker object is built. A call that raises on any rank
raises here with that rank named; a dead actor becomes WorkerGroupError instead of a hang.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import ray

from rlmega.process.heap import imports_uncollected
from rlmega.launch.errors import WorkerFailed, first_failure
from rlmega.launch.rank_imports import keep_out_unused


class WorkerGroupError(WorkerFailed):
    """A rank raised (``cause``, ``remote_traceback``), died, or did not answer; ``worker`` names it."""


class _RankHost:
    """Hosts one worker object inside a Ray actor."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]):
        keep_out_unused()  # this actor's process starts here (launch/rank_imports.py)
        self.rank, self.world_size = rank, world_size
        os.environ.update(env)
        self.worker = None

    def address(self) -> tuple[str, str]:
        """(node IP, Ray node id)."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def master_port(self) -> int:
        """A free port of this node for the group's store, held by this process until its store serves it
        (rlmega.process.bound_store.reserve_port)."""
        from rlmega.process.bound_store import reserve_port

        return reserve_port()

    def start(
        self,
        master: tuple[str, int],
        local_rank: int,
        local_world_size: int,
        cls,
        args: tuple,
        kwargs: dict,
    ) -> None:
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
        )
        # the backend's imports (megatron-core or FSDP's stack): rlmega/process/heap.py
        with imports_uncollected():
            # an Actor builds nothing before setup (rlmega/learner/actor_api.py)
            self.worker = cls(*args, **kwargs)

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def call_quiet(self, method: str, *args, **kwargs) -> None:
        """``call``, keeping the result here (see WorkerGroup.call_rank0)."""
        getattr(self.worker, method)(*args, **kwargs)


class WorkerGroup:
    def __init__(
        self,
        cls,
        world_size: int,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env: dict[str, str] | None = None,
        placement_group=None,
        timeout_s: float = 1800.0,
        name: str = "trainer",
        wait: bool = True,
    ):
        """``name``: what errors call the ranks ("trainer rank 3", "critic rank 0"). ``wait``: return once
        every rank built its worker object; False: as soon as that is under way (``starting`` holds the
        refs to wait on; calls made meanwhile run after it, in the order they were made)."""
        self.world_size, self.timeout_s, self.name = world_size, timeout_s, name
        # One intra-op thread per rank unless told otherwise: ranks share the node's cores.
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        options: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1)
        # Ray's actor handles: their methods are reached through .remote, which Ray's typing does not describe
        Host: Any = ray.remote(_RankHost)
        self.hosts: list[Any] = []
        for rank in range(world_size):
            opts = dict(options)
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                # One group (bundle index = rank), or each rank's own (group, bundle index).
                pg, bundle = (
                    placement_group[rank]
                    if isinstance(placement_group, list)
                    else (placement_group, rank)
                )
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                )
            self.hosts.append(Host.options(**opts).remote(rank, world_size, env))
        # (one ref a call: _get names a failure by its index, and both are rank 0's)
        master = (
            self._get([self.hosts[0].address.remote()])[0][0],
            self._get([self.hosts[0].master_port.remote()])[0],
        )
        # LOCAL_RANK / LOCAL_WORLD_SIZE: the rank's index among, and the number of, the ranks on its
        # node, as torchrun sets them. Each actor sees only its own GPU (Ray sets
        # CUDA_VISIBLE_DEVICES), so rlmega.process.distributed.device_ordinal binds it to ordinal 0, not LOCAL_RANK.
        # Nodes are told apart by Ray node id: simulated nodes of one machine share an IP.
        # as each rank reports
        self.node_ids = [a[1] for a in self._get([h.address.remote() for h in self.hosts])]
        nodes = self.node_ids
        # one node: rank 0's store then listens on loopback only (rlmega.process.distributed.init_distributed)
        if len(set(nodes)) == 1:
            master = ("127.0.0.1", master[1])
        local = [sum(1 for n in nodes[:r] if n == nodes[r]) for r in range(world_size)]
        per_node = [nodes.count(nodes[r]) for r in range(world_size)]
        self.starting = [
            h.start.remote(master, local[r], per_node[r], cls, tuple(args), kwargs or {})
            for r, h in enumerate(self.hosts)
        ]
        if wait:
            self._get(self.starting)

    def names(self) -> list[str]:
        """What errors call each rank, in rank order."""
        return [f"{self.name} rank {r}" for r in range(self.world_size)]

    def _get(self, refs: list) -> list:
        """All results, but fail as soon as ANY rank fails: its peers may be blocked in a
        collective waiting for it, and would only give up at the process-group timeout."""
        try:
            return first_failure(refs, self.names()[: len(refs)], self.timeout_s)
        except WorkerFailed as e:
            raise WorkerGroupError(str(e), e.worker, e.cause, e.remote_traceback) from e
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerGroupError(
                f"{self.name} ranks did not answer within {self.timeout_s:.0f}s",
                f"{self.name} ranks",
            ) from e

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank with the same arguments (put in the object store once)."""
        return self._get(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args, **kwargs) -> list:
        """``call`` started now: one ref per rank, in rank order, to wait on later."""
        args = tuple(
            ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a
            for a in args
        )
        return [h.call.remote(method, *args, **kwargs) for h in self.hosts]

    def call_rank0(self, method: str, *args, **kwargs) -> Any:
        """``call`` on every rank, but only rank 0's result comes back; the others answer None once
        done (or their error). Every rank returns the same full result, and a large one (a batch's
        log-probs) would otherwise travel to the driver once per rank."""
        return self.submit_rank0(method, *args, **kwargs)()

    def submit_rank0(self, method: str, *args, **kwargs) -> Callable[[], Any]:
        """``call_rank0`` started now and awaited later: returns a function that waits for every rank
        and gives rank 0's result, so the driver can keep another group busy meanwhile (the critic's
        forward beside the actor's). Calls on one group run in the order they were submitted."""
        args = tuple(
            ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a
            for a in args
        )
        refs = [self.hosts[0].call.remote(method, *args, **kwargs)] + [
            h.call_quiet.remote(method, *args, **kwargs) for h in self.hosts[1:]
        ]
        return lambda: self._get(refs)[0]

    def submit_shards(
        self, method: str, shards: list, dp_of_rank: list[int], *args, **kwargs
    ) -> Callable[[], list]:
        """``method`` on every rank with its data-parallel rank's share first (``shards[d]``, put in the object
        store once and fetched only by the ranks of data-parallel rank d: rlmega/data/shards.py), the same
        other arguments. Returns a function that waits for every rank and gives one result per data-parallel
        rank: its first trainer rank's (the others answer None once done, or their error)."""
        refs_by_dp = [ray.put(s) for s in shards]
        args = tuple(
            ray.put(a) if not isinstance(a, (int, float, str, bool, type(None))) else a
            for a in args
        )
        first = first_rank_of(dp_of_rank)
        refs = [
            (h.call if first[dp_of_rank[r]] == r else h.call_quiet).remote(
                method, refs_by_dp[dp_of_rank[r]], *args, **kwargs
            )
            for r, h in enumerate(self.hosts)
        ]

        def result() -> list:
            out = self._get(refs)
            return [out[first[d]] for d in range(len(shards))]

        return result

    def shutdown(self) -> None:
        for h in self.hosts:
            ray.kill(h)
        self.hosts = []


def first_rank_of(dp_of_rank: list[int]) -> dict[int, int]:
    """{data-parallel rank: its lowest trainer rank}, the one whose result a sharded call keeps."""
    first: dict[int, int] = {}
    for r, d in enumerate(dp_of_rank):
        first.setdefault(d, r)
    return first
