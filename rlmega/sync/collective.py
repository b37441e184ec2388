"""Buckets broadcast over a torch.distributed group of one sender and the engines: the weight path
that needs no shared memory and no object store (gloo on CPU tensors, NCCL on CUDA tensors).

Why: RayTransport puts each bucket into Ray's object store, from which each engine reads it; across
nodes Ray then copies the object over its own object transfer, and on GPUs every byte also goes
through the trainer's host memory. A process group carries the bytes straight from the sender's
memory to each engine actor's (NCCL: GPU to GPU, the path verl, OpenRLHF and NeMo-RL use between
nodes); the Ray call that goes with each bucket carries only its table of contents. From the engine
actor on, a bucket takes RayTransport's path: through host shared memory into vLLM's process (on
GPUs, CUDA IPC records of the received buffer would save that hop: not built).

    sender (a trainer rank)                       each engine (RolloutWorker, a Ray actor)
    first send: host a rendezvous (TCPStore),  ->  join_weight_group: join it as rank 1..N
      make the group as rank 0
    per bucket: flatten it (one copy), call    ->  receive_broadcast: wait for its turn (seq), receive
      receive_broadcast.remote(toc), broadcast      the bytes, hand the bucket to receive_weights
                                                    (the same path as RayTransport's buckets after that)

A group is made once per sending process and kept across syncs: the driver makes one transport for
the run, each trainer rank's copy of it finds its group by the transport's key. The engines receive a
group's buckets in the order they were broadcast (``seq``), whichever of their threads takes which
call. A failure the sender sees (or a sync that did not flush) makes it give its group up; its next
sync makes a new one, and an engine retires the sender's old group when it joins the new one (an
engine whose own receive failed retires it at once). Groups given up on are kept, not destroyed
(``_retired``: destroying one with a broadcast unanswered blocks for its whole timeout).

Run on CPU with gloo (tests/e2e/test_sync_to_rollout.py: log-prob parity through training, TP1 and
TP2 pieces; across simulated nodes in tests/e2e/test_several_nodes.py; tools/bench/weight_sync.py
``--transports collective``). On one node it is slower than RayTransport (loopback TCP and a copy into
the buffer at each end; docs/rollout_engine.md). TODO(gpu), not run yet: NCCL (the backend for CUDA
tensors); the lent GPU machines have one GPU, and NCCL joins no two processes on one GPU. Its receive
buffer is on the engine actor's GPU, so the engine must hold one of its own: vLLM TP = 1
(rlmega/launch/engines.py gives a TP > 1 engine's actor no GPU) and not colocated with a trainer rank;
rlmega/config/validate.py refuses the other cases, and several senders with several engines (each
sender has its own communicator with every engine: engines taking the broadcasts in different orders
could deadlock on their GPUs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import threading
import uuid
from typing import Sequence

import torch

from rlmega.sync.pieces import Piece
from rlmega.sync.transports import Bucket, RayTransport

# each tensor's bytes start at a multiple of this in the flat buffer (any dtype's alignment)
_ALIGN = 64


@dataclasses.dataclass
class _Group:
    name: str
    pg: object  # the torch.distributed ProcessGroup (gloo or NCCL backend)
    backend: str
    store: object  # the rendezvous (the sender hosts it; kept alive with the group)
    next_seq: int = 0  # the next bucket to broadcast (sender) or receive (engine)
    broken: str | None = None
    # (sender) every sync through it has flushed: the engines are in step with it
    clean: bool = True
    turn: threading.Condition = dataclasses.field(default_factory=threading.Condition)


_PROCESS = uuid.uuid4().hex[:12]  # this process's part of its groups' names
_joined: dict[str, _Group] = {}  # an engine's groups, by name
_sending: dict[str, _Group] = {}  # a sender process's groups, by its transport's key
# Groups given up on, never deleted: destroying a gloo group with a broadcast still unanswered blocks for
# its whole timeout (up to 30 min in a run), so a failure would be reported that late. One per failure.
_retired: list[_Group] = []
_lock = threading.Lock()


def flatten(bucket: Bucket) -> tuple[torch.Tensor, list[tuple]]:
    """A bucket's bytes as one contiguous uint8 tensor on its tensors' device, and its table of
    contents: ``[(name, dtype, shape, offset, place)]``, ``place`` a Piece's (full_shape, dim, start, of)
    or None for a whole tensor."""
    tensors = [(n, (t.tensor if isinstance(t, Piece) else t).detach()) for n, t in bucket]
    devices = {t.device for _, t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"a bucket's tensors are on several devices ({sorted(map(str, devices))}): "
            "a broadcast carries one device's memory"
        )
    toc, offset = [], 0
    for (name, t), (_, orig) in zip(tensors, bucket):
        place = (
            (orig.full_shape, orig.dim, orig.start, orig.of) if isinstance(orig, Piece) else None
        )
        toc.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, place))
        offset = -(-(offset + t.nbytes) // _ALIGN) * _ALIGN
    flat = torch.empty(offset, dtype=torch.uint8, device=tensors[0][1].device if tensors else "cpu")
    for (_, t), entry in zip(tensors, toc):
        if t.nbytes:
            flat[entry[3] : entry[3] + t.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat, toc


def unflatten(flat: torch.Tensor, toc: list[tuple]) -> Bucket:
    """The bucket ``flatten`` made, as views of ``flat`` (a Piece where it was one)."""
    out = []
    for name, dtype, shape, offset, place in toc:
        dt = getattr(torch, dtype)
        nbytes = dt.itemsize * _numel(shape)
        t = flat[offset : offset + nbytes].view(dt).reshape(shape)
        out.append((name, t if place is None else Piece(t, tuple(place[0]), *place[1:])))
    return out


def nbytes_of(toc: list[tuple]) -> int:
    """The flat buffer's size for a table of contents (its last tensor's end, aligned)."""
    if not toc:
        return 0
    name, dtype, shape, offset, _ = toc[-1]
    return -(-(offset + getattr(torch, dtype).itemsize * _numel(shape)) // _ALIGN) * _ALIGN


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _new_process_group(store, rank: int, world: int, backend: str, timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":  # TODO(gpu): not run yet
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise ValueError(f"weight group backend {backend!r}: gloo or nccl")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---- the engine's side (called by RolloutWorker.join_weight_group / receive_broadcast) -----------
def join(
    name: str, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float
) -> None:
    """Join sender group ``name`` as ``rank``: returns once every member has joined. The same sender's
    earlier group (a name that differs only after its last dot) is retired: the sender gave it up."""
    import torch.distributed as dist

    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "a weight group over NCCL needs a GPU in the engine's actor (vLLM tensor parallel "
            "size 1; at TP > 1 the actor holds none): use rollout.weight_transport: ray"
        )
    sender = name.rpartition(".")[0] + "."
    with _lock:
        for old in [g for n, g in _joined.items() if n.startswith(sender)]:
            _retire(old, "its sender made a new group")
    store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
    pg = _new_process_group(dist.PrefixStore(name, store), rank, world, backend, timeout_s)
    with _lock:
        _joined[name] = _Group(name, pg, backend, store)


def receive(name: str, seq: int, toc: list[tuple], timeout_s: float) -> Bucket:
    """Bucket ``seq`` of group ``name``, once the buckets before it have been received (any thread)."""
    with _lock:
        group = _joined.get(name)
    if group is None:
        raise RuntimeError(
            f"weight group {name} is unknown here (never joined, or broken by an earlier failure)"
        )
    with group.turn:
        if not group.turn.wait_for(
            lambda: group.next_seq == seq or group.broken, timeout=timeout_s
        ):
            _break(group, f"bucket {seq} waited {timeout_s:g} s for bucket {group.next_seq}")
        if group.broken:
            raise RuntimeError(f"weight group {name} is broken: {group.broken}")
        device = (
            torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else "cpu"
        )
        flat = torch.empty(nbytes_of(toc), dtype=torch.uint8, device=device)
        try:
            _ended(group.pg.broadcast(flat, 0), group.backend)
        except BaseException as e:
            _break(group, f"{type(e).__name__}: {e}")
            raise
        group.next_seq += 1
        group.turn.notify_all()
    return unflatten(flat, toc)


def _ended(work, backend: str) -> None:
    """Wait for a broadcast. NCCL's ``wait`` only orders the current stream after it: synchronise, so its
    bytes are there. A broken NCCL broadcast is not an exception here: NCCL's watchdog ends the process
    when the group's timeout passes (TORCH_NCCL_ASYNC_ERROR_HANDLING), and Ray names the engine or
    trainer rank that died."""
    work.wait()
    if backend == "nccl":
        torch.cuda.current_stream().synchronize()


def _break(group: _Group, why: str) -> None:
    """Out of step for good: refuse its later buckets, forget it (the sender makes a new group)."""
    with _lock:
        _retire(group, why)
    with group.turn:
        group.turn.notify_all()


def _retire(group: _Group, why: str) -> None:
    """(under _lock) Out of the registries for good, kept alive (see _retired)."""
    group.broken = group.broken or why
    if _joined.get(group.name) is group:
        del _joined[group.name]
    _retired.append(group)


# ---- the sender's side ----------------------------------------------------------------------------
class CollectiveTransport(RayTransport):
    """Buckets as broadcasts over a process group of this sender and every engine (module docstring).

    Pipelined like RayTransport: at most ``max_in_flight`` buckets unacknowledged, and the engines
    take bucket k while this sender flattens and broadcasts bucket k+1; one reload per sync in each
    engine. Each rank's copy is its own sender with its own group, made at its first ``send``.
    """

    takes_pieces = True  # the engines place each TP rank's blocks, as with RayTransport
    # (it exists for engines on other nodes; on one node RayTransport writes their memory)
    local_slots = False

    def __init__(self, engines: Sequence, timeout_s: float = 600.0, max_in_flight: int = 2):
        super().__init__(engines, timeout_s, max_in_flight)
        # made once (the driver's); every copy of this transport shares it
        self.key = uuid.uuid4().hex

    def begin(self, version: int, nbytes_hint: int) -> None:
        """(Nothing to open ahead: the first ``send`` makes or checks the group.)"""

    def send(self, bucket: Bucket, version: int) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._wait(*self._in_flight.popleft())
        flat, toc = self._put(bucket)
        # A sync's first bucket: a group whose last sync did not flush (this rank failed between its
        # sends) may be out of step with the engines: make a new one.
        group = self._group(_backend(flat.device), fresh=self._version is None)
        group.clean = False
        seq, group.next_seq = group.next_seq, group.next_seq + 1
        try:
            refs = [
                e.receive_broadcast.remote(
                    group.name, seq, toc, version, self.sender, self.timeout_s
                )
                for e in self.engines
            ]
            work = group.pg.broadcast(flat, 0)
        except BaseException as e:
            self._drop(f"{type(e).__name__}: {e}")
            raise
        # (the flat buffer stays in the queue until its broadcast has ended)
        self._in_flight.append(
            (
                refs,
                f"the bucket starting with {bucket[0][0]!r} (weights version {version})",
                work,
                flat,
            )
        )
        self._version = version

    def _put(self, bucket: Bucket) -> tuple[torch.Tensor, list[tuple]]:
        """The bucket as one buffer to broadcast (its one copy, as ``ray.put`` is RayTransport's)."""
        return flatten(bucket)

    def _wait(self, refs: list, what: str, work=None, flat=None) -> list:
        """The engines' answers to one call and, for a bucket, this side's broadcast having ended."""
        try:
            answers = super()._wait(refs, what)
            if work is not None:
                _ended(work, _backend(flat.device))
        except BaseException as e:
            self._drop(f"{type(e).__name__}: {e}")
            raise
        return answers

    def flush(self) -> None:
        super().flush()  # (a failure has dropped the group: _wait)
        group = _sending.get(self.key)
        if group is not None:
            group.clean = True

    def _group(self, backend: str, fresh: bool) -> _Group:
        """This process's group with the engines (made at the first send, after a failure, and when
        the last sync through it did not flush)."""
        group = _sending.get(self.key)
        if (
            group is not None
            and group.backend == backend
            and not group.broken
            and (group.clean or not fresh)
        ):
            return group
        if group is not None:
            self._drop("replaced")
        import ray
        import torch.distributed as dist

        # The engines retire this sender's earlier group when it joins one with the same name up to the last dot.
        name, world = f"{self.key}.{_PROCESS}.{uuid.uuid4().hex[:8]}", 1 + len(self.engines)
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(
            host,
            0,
            world,
            True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        refs = [
            e.join_weight_group.remote(
                name, host, store.port, i + 1, world, backend, self.timeout_s
            )
            for i, e in enumerate(self.engines)
        ]
        # Made in a thread: an engine that fails to join is named from its answer (the group would only time out).
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            made = pool.submit(
                _new_process_group, dist.PrefixStore(name, store), 0, world, backend, self.timeout_s
            )
            RayTransport._wait(self, refs, f"joining weight group {name} ({backend})")
            pg = made.result(timeout=self.timeout_s)
        finally:
            pool.shutdown(wait=False)
        group = _sending[self.key] = _Group(name, pg, backend, store)
        return group

    def _drop(self, why: str) -> None:
        """A failure leaves the group out of step: the next send makes a new one."""
        with _lock:
            group = _sending.pop(self.key, None)
            if group is not None:
                _retire(group, why)
