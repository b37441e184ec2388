"""A sender on the engines' node writes its buckets into the engines' shared memory itself.

Why: through the object store a bucket was copied twice before vLLM's reload read it: by the sender
into Ray's object store (``ray.put``, serial: at TP 1 the whole model is one bucket, 0.03 s of a
0.28 s sync of the 0.4 GB benchmark model), then by the RolloutWorker into a shared-memory slot
(rlmega/sync/shm_slots.py). A sender on the engine's node can write the slot itself: one copy,
and the engine's reload starts before it (``begin_weights`` opens the sync before the first bucket is
gathered: RayTransport.begin, which the actors call).

    a sync's start          begin_weights on every engine: the sync's directory (the engine's one
                            reload starts reading it), its model workers' folders, its node, and
                            what makes a whole vLLM layer (rlmega/sync/fused_layers.py)
    each bucket             whole vLLM layers (the incomplete ones held back, as the RolloutWorker
                            does) in pieces of ~FILE_BYTES, each into a slot of this process's pool
                            for that engine (a new file when none is free), at most MAX_UNREAD unread
    flush                   what is still held back goes the object store's way (the RolloutWorker
                            completes those layers with what it holds), then ``finish_weights``,
                            whose answer names the slots the readers retired: they are dropped here

The slots follow shm_slots' protocol unchanged (tickets, held reads, retired slots); this process is
their writer instead of the RolloutWorker. A pool per engine: a model worker maps a slot at the first
sync it reads it in, while its file is still in that sync's directory, so a slot serves one engine.
RayTransport uses it for buckets of whole CPU tensors when its one engine is on this node; TP ranks'
pieces (rlmega/sync/pieces.py) still go through the object store, where the RolloutWorker places them,
and so do several engines' buckets (this sender would copy each bucket once per engine, one after the
other; through the object store it is copied once, and the engines copy it in parallel).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Callable, Sequence

from rlmega.sync import bucket_files
from rlmega.sync.bucket_files import FILE_BYTES, MAX_UNREAD, files_of_layers
from rlmega.sync.fused_layers import FusedLayers
from rlmega.sync.shm_slots import SlotPool

# engine actor id -> this process's slots for it (kept across syncs)
_pools: dict[str, SlotPool] = {}


class LocalSync:
    """One sync's writes into every engine's directory, from one sender (a RayTransport copy)."""

    def __init__(self, engines: Sequence, infos: list[dict], sender: str, timeout_s: float):
        self.layers = FusedLayers(*infos[0]["layers"])  # (every engine serves the same model)
        self.targets = [
            (
                info["directory"],
                info["ranks"],
                _pools.setdefault(engine._actor_id.hex(), SlotPool(FILE_BYTES)),
            )
            for engine, info in zip(engines, infos)
        ]
        self.tag, self.timeout_s = f"-{sender[:12]}", timeout_s
        self.seq = itertools.count()

    @staticmethod
    def begin(
        engines: Sequence,
        version: int,
        sender: str,
        nbytes_hint: int,
        timeout_s: float,
        answers: Callable[[list, str], list],
    ) -> LocalSync | None:
        """Open the sync on every engine; a LocalSync when all of them are on this node and read from
        /dev/shm, else None (the sync is open all the same: the buckets then come through Ray)."""
        import ray

        infos = answers(
            [e.begin_weights.remote(version, sender, nbytes_hint) for e in engines],
            f"the start of weights version {version}",
        )
        # several engines: one object-store copy that their workers copy in parallel
        if len(infos) != 1:
            return None
        here, info = ray.get_runtime_context().get_node_id(), infos[0]
        # (the folder check: a Ray Client driver reports the head's node, and a private /dev/shm hides it)
        if (
            info["node"] != here
            or os.path.dirname(info["directory"]) != bucket_files.SHM
            or not os.path.isdir(os.path.join(info["directory"], str(info["ranks"][0])))
        ):
            return None
        return LocalSync(engines, infos, sender, timeout_s)

    def send(self, bucket: list) -> None:
        """Write the bucket's whole vLLM layers into every engine's stream (returns once written)."""
        for chunk in files_of_layers(self.layers.complete(bucket), FILE_BYTES):
            seq = next(self.seq)
            for directory, ranks, pool in self.targets:
                try:
                    self._wait_for_room(directory, ranks)
                    # no slot free: a file
                    if pool.write(directory, seq, chunk, ranks, self.tag) is None:
                        bucket_files.write_bucket(directory, seq, chunk, ranks, self.tag)
                # the sync's directory went with a failed reload: finish says why
                except FileNotFoundError as e:
                    raise Ended(
                        f"the engine's weight stream {directory} ended while buckets still came: {e}"
                    ) from e

    def held_back(self) -> list:
        """The tensors of vLLM layers this sync has not completed (the RolloutWorker completes them)."""
        return self.layers.take_pending()

    def end(self, retired: list[list[str]] | None) -> None:
        """The sync's reloads have ended: drop the slots the readers retired (``retired`` per engine,
        as ``finish_weights`` answered), or every slot the sync used when it failed (None)."""
        for i, (directory, _, pool) in enumerate(self.targets):
            pool.end_sync(
                directory, failed=retired is None, retired=None if retired is None else retired[i]
            )

    def _wait_for_room(self, directory: str, ranks: list[int]) -> None:
        deadline, nap = time.monotonic() + self.timeout_s, 1e-4
        while bucket_files.unread(directory, ranks) >= MAX_UNREAD:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine read no weight bucket of {directory} for {self.timeout_s:g} s"
                )
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)


class Ended(RuntimeError):
    """The engine's stream is gone; the transport asks the engine why (finish_weights raises it)."""
