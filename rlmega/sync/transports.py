"""How a bucket of HF-named tensors reaches the rollout engines.

``sync_model_to_rollout`` (MegatronActor, FSDPActor) streams each pipeline stage's weights as
buckets from one sender rank per stage and hands each bucket to a transport:

    DirectTransport([worker, ...])   engines are objects in this process (tests, one-process runs)
    RayTransport([handle, ...])      engines are Ray actors: the bucket goes into the object store
                                     once, as raw bytes, and every engine reads it from there
                                     (zero-copy on a node); whole host tensors for one engine on the
                                     sender's node are written straight into its shared memory
                                     instead (rlmega/sync/local_slots.py)
    CudaIpcTransport([handle, ...])  same node, GPU: CUDA IPC handles of the trainer's tensors, no copy
                                     through the host (its records ran on one GPU;
                                     ``rollout.weight_transport: cuda_ipc``)
    CollectiveTransport([handle, ...])  any node: each bucket broadcast over a torch.distributed group of
                                     the sender and the engines, gloo or NCCL (rlmega/sync/collective.py;
                                     ``rollout.weight_transport: collective``)

A transport is picklable (it travels to the trainer ranks; each rank's copy is its own sender) and
has two methods: ``send(bucket, version)`` hands a bucket over (it may return before the engines
have loaded it), and ``flush()`` returns once every engine has loaded everything sent, or raises
naming the engine that failed. ``takes_pieces`` says whether a bucket may hold Pieces (each TP
rank's block of an HF tensor, rlmega/sync/pieces.py), which the engine side places: then every TP
rank sends and nobody gathers, and a sender flushes only after its last bucket (a flush waits for the
sync's reload, which waits for every TP rank's blocks). The sender calls ``flush()`` before the sync's closing barrier.

The engine side (RolloutWorker) is ``receive_weights(bucket, version, sender)`` per bucket and
``finish_weights(version, sender)`` at the flush, and ``begin_weights`` (RayTransport, at the sync's
start: rlmega/sync/local_slots.py): the engine loads a sync's buckets in ONE vLLM reload, opened by
``begin_weights`` or the first bucket and closed once every sender has finished
(rlmega/rollout/weight_stream.py). ``sender`` is a key per transport copy.
"""

from __future__ import annotations

import collections
import uuid
import warnings
from typing import Sequence

import torch

from rlmega.sync.byte_views import byte_array
from rlmega.sync.pieces import Piece

Bucket = list[tuple[str, torch.Tensor]]


def _tensors_from_bytes(names, arrays, dtypes, shapes, places=None) -> Bucket:
    """Where a bucket is read (the engine): tensors over the object store's memory, no copy; a piece's
    block (``places``: its (full_shape, dim, start, of), None for a whole tensor) as a Piece."""
    with warnings.catch_warnings():
        # "The given NumPy array is not writable": the engine's weight loaders only read them.
        warnings.simplefilter("ignore", UserWarning)
        tensors = [
            torch.from_numpy(a).view(dt).reshape(sh) for a, dt, sh in zip(arrays, dtypes, shapes)
        ]
    return [
        (n, t if place is None else Piece(t, *place))
        for n, t, place in zip(names, tensors, places or [None] * len(tensors))
    ]


class _RawBucket:
    """A bucket that pickles as each tensor's own bytes (numpy byte views: pickle-5 out-of-band).

    A torch.Tensor pickles its whole storage: a view into Megatron's flat DDP parameter buffer
    (every replicated norm weight) would carry the whole buffer, once per tensor (10.4 GB for a
    0.4 GB model at TP1), and torch's storage pickling copies several times on both sides.
    Here ray.put makes one copy into the object store and the reader none. The byte views are
    not ``Tensor.numpy()`` (rlmega/sync/byte_views.py): the sender's storages stay resizable for the release.
    """

    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    def __reduce__(self):
        ts = [
            (t.tensor if isinstance(t, Piece) else t).detach().cpu().contiguous()
            for _, t in self.bucket
        ]
        places = [
            (p.full_shape, p.dim, p.start, p.of) if isinstance(p, Piece) else None
            for _, p in self.bucket
        ]
        return _tensors_from_bytes, (
            [n for n, _ in self.bucket],
            [byte_array(t) for t in ts],
            [t.dtype for t in ts],
            [tuple(t.shape) for t in ts],
            places if any(places) else None,
        )


class _Sender:
    """A transport copy's key at the engines: made in the process that first sends, never pickled
    (the driver's transport and each rank's copy must not share one)."""

    _sender: str | None = None

    @property
    def sender(self) -> str:
        if self._sender is None:
            self._sender = uuid.uuid4().hex
        return self._sender

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_sender", None)
        return state


class DirectTransport(_Sender):
    takes_pieces = True  # the engines place each TP rank's blocks (rlmega/sync/pieces.py)

    def __init__(self, engines: Sequence):
        self.engines = list(engines)
        self._version: int | None = None

    def send(self, bucket: Bucket, version: int) -> None:
        for engine in self.engines:
            engine.receive_weights(bucket, version, self.sender)
        self._version = version

    def flush(self) -> None:
        """Every engine's reload of this sync has ended (``send`` handed the buckets over)."""
        version, self._version = self._version, None
        if version is None:
            return
        for i, engine in enumerate(self.engines):
            try:
                engine.finish_weights(version, self.sender)
            except Exception as e:
                raise RuntimeError(
                    f"rollout engine {i} failed to load weights version {version}: {e}"
                ) from e


class RayTransport(_Sender):
    """Buckets through Ray's object store, pipelined: the engines take bucket k while the sender
    gathers and puts bucket k+1, and load each bucket as it comes, in the sync's one reload.

    ``begin`` (the actors call it before gathering; else the first bucket) opens the sync on every
    engine (``begin_weights``: their reloads start). When the one engine is on this node, buckets of
    whole host tensors skip the object store: this sender writes them into the engine's shared-memory
    slots itself (rlmega/sync/local_slots.py; one copy instead of two, and no serial put before the
    engine starts). TP ranks' pieces, device tensors, engines on other nodes and several engines take
    the object store as below.

    At most ``max_in_flight`` buckets (default 2) are unacknowledged: before putting bucket k+2 the
    sender waits until every engine has taken bucket k (handed it to its model process, which has
    room for two unread buckets: rlmega/rollout/weight_stream.py), so the object store holds at
    most two buckets per sender whatever the model's size. The engines are threaded actors
    (max_concurrency, see rlmega/launch/roles.py ``_engine_options``), so the buckets in flight may
    arrive at once and in any order: a fused vLLM layer split across buckets waits in the engine
    until its last piece arrives, so no order exposes a half-loaded layer. ``flush`` waits for the
    reload. The engines do not retry tasks (a retried bucket would load twice).
    """

    takes_pieces = True  # the engines place each TP rank's blocks (rlmega/sync/pieces.py)
    # Buckets of whole host tensors for engines on this node go straight into their shared memory
    # (rlmega/sync/local_slots.py) instead of the object store; false: always the object store.
    local_slots = True

    def __init__(self, engines: Sequence, timeout_s: float = 600.0, max_in_flight: int = 2):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: at least 1 (the bucket being loaded)")
        self.engines, self.timeout_s, self.max_in_flight = list(engines), timeout_s, max_in_flight
        self._in_flight: collections.deque = collections.deque()  # (refs, what), oldest first
        self._version: int | None = None
        # this sync's LocalSync, when its one engine is on this node (set by begin)
        self._local = None

    def begin(self, version: int, nbytes_hint: int) -> None:
        """Open the sync on every engine before the first bucket is ready (their reloads start while
        the sender gathers it); ``send`` does it at the first bucket otherwise. ``nbytes_hint``: the
        largest tensor known to come (the engine keeps shared memory for it, else uses a disk folder)."""
        if self._version is None and self.local_slots:
            from rlmega.sync.local_slots import LocalSync

            self._local = LocalSync.begin(
                self.engines, version, self.sender, nbytes_hint, self.timeout_s, self._wait
            )
        self._version = version

    def send(self, bucket: Bucket, version: int) -> None:
        try:
            self.begin(version, max(t.nbytes for _, t in bucket))  # (once per sync)
            if self._local is not None and _whole_host_tensors(bucket):
                self._write_local(bucket)
                return
            self._send_through_store(bucket, version)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A send failed: this copy's sync is over (the caller fails the sync), and the slots it wrote
        are never filled again (a reader may still view them, or never mapped them)."""
        local, self._local, self._version = self._local, None, None
        if local is not None:
            local.end(None)

    def _send_through_store(self, bucket: Bucket, version: int) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._wait(*self._in_flight.popleft())
        ref = self._put(bucket)  # once, shared by all engines
        refs = [e.receive_weights.remote(ref, version, self.sender) for e in self.engines]
        self._in_flight.append(
            (refs, f"the bucket starting with {bucket[0][0]!r} (weights version {version})")
        )

    def _write_local(self, bucket: Bucket) -> None:
        from rlmega.sync.local_slots import Ended

        try:
            self._local.send(bucket)
        except Ended:  # the engine's stream failed: its own error says why
            self.flush()
            raise
        # Any other failure (no room left, no engine reading): no finish, so the engine never labels the
        # weights it loaded so far with this version; its stream ends failed at its idle timeout.

    def flush(self) -> None:
        version, self._version = self._version, None
        local, self._local = self._local, None
        retired = None
        try:
            # layers it could not complete: the RolloutWorker holds their other tensors
            if local is not None:
                rest = local.held_back()
                if rest:
                    self._send_through_store(rest, version)
            while self._in_flight:
                self._wait(*self._in_flight.popleft())
            if version is not None:
                retired = self._wait(
                    [e.finish_weights.remote(version, self.sender) for e in self.engines],
                    f"weights version {version}",
                )
        finally:
            self._in_flight.clear()  # after an error the rest is abandoned, not waited on again
            if local is not None:
                local.end(retired)  # (None after a failure: every slot the sync used is retired)

    def __getstate__(self):  # a copy for another process starts with no sync of its own
        state = super().__getstate__()
        state.update(_local=None, _version=None, _in_flight=collections.deque())
        return state

    def _put(self, bucket: Bucket):
        import ray

        return ray.put(_RawBucket(bucket))

    def _wait(self, refs: list, what: str) -> list:
        """Every engine's answer to one call; raise naming the engine that did not answer or failed."""
        import ray

        _, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if late:
            late_ids = {r.hex() for r in late}
            names = ", ".join(
                f"rollout engine {i}" for i, r in enumerate(refs) if r.hex() in late_ids
            )
            raise TimeoutError(f"{names} did not load {what} within {self.timeout_s:g} s")
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except Exception as e:
                raise RuntimeError(f"rollout engine {i} failed to load {what}: {e}") from e
        return out


def _whole_host_tensors(bucket: Bucket) -> bool:
    """Buckets the local path writes: whole tensors (not TP ranks' pieces) in host memory."""
    return all(type(t) is torch.Tensor and t.device.type == "cpu" for _, t in bucket)


class CudaIpcTransport(RayTransport):
    """Same node, GPU tensors: the engines get CUDA IPC handles of the trainer's tensors
    (rlmega/sync/cuda_ipc.py) instead of their bytes, and load them in the sync's one reload, with
    no copy through host memory. The sent tensors are held here until ``flush`` has returned.

    Its records have run on one GPU into a real engine (cuda_ipc.py: 0.20 s for a 0.92 GiB sync), not
    yet through Ray. Selected nowhere: Ray gives each engine only its own GPUs (CUDA_VISIBLE_DEVICES),
    and a handle opens only where its GPU is visible. Raises at ``send`` without CUDA or for host
    tensors. It takes whole tensors only: the engine's worker, not the RolloutWorker, opens the
    handles, so there is no place to assemble pieces before the reload.
    """

    takes_pieces = False
    local_slots = False  # (its buckets are device tensors)

    def __init__(self, engines: Sequence, timeout_s: float = 600.0, max_in_flight: int = 2):
        super().__init__(engines, timeout_s, max_in_flight)
        self._held: list[torch.Tensor] = []

    def flush(self) -> None:
        try:
            super().flush()
        finally:
            self._held.clear()  # the engines have loaded (or given up on) what the handles point at

    def _put(self, bucket: Bucket):
        from rlmega.sync.cuda_ipc import ipc_bucket

        records, kept = ipc_bucket(bucket)
        self._held += kept
        return records  # small: passed inline with the call, not through the object store
