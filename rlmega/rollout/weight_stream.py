"""One weight sync, one reload in the engine: the RolloutWorker's side of loading weights.

The engine's side is ``rlmega_load_stream`` (rlmega/rollout/vllm_extension.py: why one reload per
sync). A sync's first bucket opens a sync directory (rlmega/sync/bucket_files.py) and starts that
call, not awaited; each bucket's whole vLLM layers (rlmega/sync/fused_layers.py) are written in
pieces of about ``FILE_BYTES``, so the engine loads the first while the next is written, and at most
``MAX_UNREAD`` wait unread: shared memory never holds a whole large model. A piece goes into a
shared-memory slot kept across syncs (rlmega/sync/shm_slots.py: no new pages each sync), or, when
none is free and the pool is full, into a new file. ``finish`` ends the stream once every sender of
the sync has finished, waits for the reload, resets the prefix cache, and only then sets the weights
version and lets requests through (they wait while a stream is open: they would run on the new
weights labelled with the old version).

Senders: a sync may have several at once (one per pipeline stage and TP rank, each its own transport;
one-shot ``update_weights`` calls from many threads), each a key. The stream stays open until every
sender that sent into it has finished and no tensor waits for other TP ranks' pieces (so a TP rank
whose first bucket comes late still lands in it); a sender whose first bucket comes after the others
all finished opens a second reload: correct, only slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import threading
import time
from typing import Any

from rlmega.sync import bucket_files
from rlmega.sync.bucket_files import FILE_BYTES, MAX_UNREAD, files_of_layers
from rlmega.sync.fused_layers import FusedLayers
from rlmega.sync.pieces import Assembler
from rlmega.sync.shm_slots import RETIRED, SlotPool

logger = logging.getLogger(__name__)

# TP ranks' blocks waiting for the other ranks' (a few 512 MiB buckets' worth)
HELD_PIECES_BYTES = 2 << 30
# the engine ends a stream with no bucket and no end for this long (a dead sender)
IDLE_TIMEOUT_S = 600.0


class _Sync:
    """One open stream: its directory, the engine call loading it, and who sends into it."""

    def __init__(self, directory: str, future, version: int):
        self.directory, self.future, self.version = directory, future, version
        self.senders: set = set()
        self.seq = itertools.count()
        self.done = threading.Event()  # the reload returned (or failed) and all is cleaned up
        self.error: BaseException | None = None
        # the readers' retired-slot marks, read before the directory goes
        self.retired: list[str] = []


class WeightStream:
    def __init__(
        self, worker, layers: FusedLayers, ranks: list[int], idle_timeout_s: float = IDLE_TIMEOUT_S
    ):
        """``worker``: the RolloutWorker (its engine, loop, version and gate); ``ranks``: its model
        workers' folder names (``rlmega_rank``)."""
        self.worker, self.layers, self.ranks, self.idle_timeout_s = (
            worker,
            layers,
            ranks,
            idle_timeout_s,
        )
        # re-entered when the engine call fails at once (_start's callback)
        self._lock = threading.RLock()
        self._open: _Sync | None = None
        self._by_sender: dict[Any, _Sync] = {}
        self.slots = SlotPool(FILE_BYTES)  # shared memory the buckets go through, kept across syncs
        # TP ranks' blocks of a tensor, held until all have come (rlmega/sync/pieces.py)
        self.pieces = Assembler()
        self.reloads = 0  # reloads the engine has finished (one per sync)
        # what each model worker's rlmega_load_stream returned, last sync
        self.last_load: list[dict] = []
        # The last failed sync's (version, what failed): its late buckets (other senders' in flight) are
        # refused, not loaded in a new stream that no finish would close (requests would wait for its idle
        # timeout). Set under the lock that closes the sync, so no late bucket slips in between.
        self._failed: tuple[int, str] | None = None
        # Set while no stream is open (loop thread only: requests wait on it in rlmega/rollout/generation.py).
        self.loaded = asyncio.Event()
        self.loaded.set()

    def check_ready(self) -> None:
        """Raise if a fused layer waits for its other tensors, or a tensor for its other TP ranks'
        pieces, and no sync is loading (that sync ended without them). While one is, a request waits
        for its end instead (generation.py)."""
        if self._open is None:
            self.layers.check_none_pending()
            names = self.pieces.pending()
            if names:
                raise RuntimeError(
                    f"{len(names)} weights wait for the pieces of their other TP ranks (e.g. "
                    f"{names[:4]}): a sync ended without them (a trainer rank that did not send)"
                )

    def begin(self, version: int, sender, nbytes_hint: int) -> str:
        """Open (or join) a sync for ``sender`` without a bucket; its directory, where a sender on this
        node writes whole vLLM layers itself (rlmega/sync/local_slots.py). The engine's reload starts now."""
        with self._lock:
            sync = self._open
            if sync is None:
                self._refuse_if_failed(version)
                sync = self._start(max(FILE_BYTES, nbytes_hint), version)
            sync.senders.add(sender)
            self._by_sender[sender] = sync
        return sync.directory

    def receive(self, named_tensors, version: int, sender) -> None:
        """Hand a bucket's whole layers to the engine (returns once written, not loaded)."""
        named_tensors = list(named_tensors)
        if not named_tensors:
            return
        with self._lock:
            if self._open is None:
                self._refuse_if_failed(version)
            # Placing the pieces and joining the sync in one step: a finish deciding meanwhile whether the
            # sync may close sees both (a bucket whose pieces all wait still joins: its sender counts).
            groups = self.layers.complete(self.pieces.add(named_tensors, version, sender))
            sync = self._open
            if sync is None:  # (also for a bucket of held pieces only: its sender is in this sync)
                largest = max([sum(t.nbytes for _, t in g) for g in groups], default=0)
                sync = self._start(max(FILE_BYTES, largest), version)
            sync.senders.add(sender)
            self._by_sender[sender] = sync
        for chunk in files_of_layers(groups, FILE_BYTES):
            try:
                self._wait_for_room(sync, version)
                seq = next(sync.seq)
                # no slot free: a file
                if self.slots.write(sync.directory, seq, chunk, self.ranks) is None:
                    bucket_files.write_bucket(sync.directory, seq, chunk, self.ranks)
            except OSError:  # the sync's directory went with a failed engine call: say why
                self._raise_if_ended(sync, version)
                raise
        self._wait_for_pieces(sync, version, sender)

    def finish(self, version: int, sender) -> list[str]:
        """``sender`` has sent everything; returns once what it sent is loaded, with ``version`` set: the
        slots the readers retired in that sync (``retired-<id>`` marks; a writer never fills them again)."""
        with self._lock:
            sync = self._by_sender.pop(sender, None) or self._open
            if sync is None:  # nothing sent and nothing loading: the version alone
                self._refuse_if_failed(version)
                self.worker._version = version
                return []
            sync.senders.discard(sender)
            # Pieces still waiting: a TP rank's sender has yet to send (or finish); it will, into this sync.
            closing = sync is self._open and not sync.senders and not self.pieces.pending(version)
            if closing:
                self._open = None
                bucket_files.end(sync.directory)
        if closing:
            try:
                self.last_load = self.worker._result(sync.future)
                # (late blocks of a failed sync's version: they never complete)
                self.pieces.drop_older(version)
                self.reloads += 1
                self.worker._run(self.worker._engine.reset_prefix_cache())
                if self.worker._engine.model_config.is_multimodal_model:
                    # image embeddings the vision tower computed with the old weights (and the reload leaves the
                    # runner's encoder cache out of step with the scheduler's: "Encoder cache miss")
                    self.worker._run(self.worker._engine.reset_encoder_cache())
                self.worker._version = version
            except BaseException as e:
                sync.error = e
            finally:
                self._close(sync)
        sync.done.wait()
        if sync.error is not None:
            # again: a writer in another process (local_slots.py) may have added a file after the first removal
            shutil.rmtree(sync.directory, ignore_errors=True)
            raise RuntimeError(
                f"the rollout engine failed to load weights version {version}: "
                f"{type(sync.error).__name__}: {sync.error}"
            ) from sync.error
        return sync.retired

    def _refuse_if_failed(self, version: int) -> None:
        """A bucket or finish of the version whose sync failed, with no sync open: a sender that was late."""
        if self._failed is not None and self._failed[0] == version:
            raise RuntimeError(
                f"weights version {version} failed to load already ({self._failed[1]}); a late "
                "bucket or finish of it is refused: send the weights again as a new version"
            )

    def close(self) -> None:
        """Let go of the shared-memory slots (the engine is shut down, or going)."""
        self.slots.close()

    def _start(self, nbytes_hint: int, version: int) -> _Sync:
        directory = bucket_files.open_sync_dir(self.ranks, nbytes_hint)
        w = self.worker
        future = asyncio.run_coroutine_threadsafe(
            w._engine.collective_rpc("rlmega_load_stream", args=(directory, self.idle_timeout_s)),
            w._loop,
        )
        sync = self._open = _Sync(directory, future, version)  # (the caller holds the lock)
        w._loop.call_soon_threadsafe(self.loaded.clear)
        future.add_done_callback(lambda _: self._ended_early(sync))
        return sync

    def _ended_early(self, sync: _Sync) -> None:
        """The engine's call returned while the sync was open: it failed (or timed out waiting)."""
        with self._lock:
            if self._open is not sync:
                return  # finish closed it and handles the result
            self._open = None
            exc = sync.future.exception()  # (done: this is its callback)
            sync.error = exc or RuntimeError("the engine's weight stream ended before the sync did")
            waiting = self.pieces.pending()
            if waiting:  # the likely cause: a TP rank that never sent its blocks
                sync.error = RuntimeError(
                    f"{sync.error} ({len(waiting)} tensors still waited for other TP ranks' "
                    f"blocks, e.g. {waiting[:3]}: a trainer rank that did not send?)"
                )
            # (before a late bucket looks)
            self._failed = (sync.version, f"{type(sync.error).__name__}: {sync.error}")
        logger.error("weight stream %s ended early: %r", sync.directory, sync.error)
        self._close(sync)

    def _close(self, sync: _Sync) -> None:
        if sync.error is not None:
            self.pieces.clear()  # a failed sync's held pieces never complete
            self._failed = (sync.version, f"{type(sync.error).__name__}: {sync.error}")
        # (while its tickets are there)
        self.slots.end_sync(sync.directory, failed=sync.error is not None)
        with contextlib.suppress(OSError):
            sync.retired = [n for n in os.listdir(sync.directory) if n.startswith(RETIRED)]
        shutil.rmtree(sync.directory, ignore_errors=True)
        self.worker._loop.call_soon_threadsafe(self.loaded.set)
        sync.done.set()

    def _wait_for_pieces(self, sync: _Sync, version: int, sender) -> None:
        """Hold this sender while more than HELD_PIECES_BYTES of pieces wait for other TP ranks' (they
        pin their object-store buffers, outside the transports' two-buckets-in-flight bound) and some
        of them are its own. Never a deadlock: ranks send the same tensors in the same order, so the
        first tensor still waiting misses a rank all of whose pieces are complete; that rank is never
        held, and its next bucket completes it."""
        nap = 1e-4
        while (
            not sync.future.done()
            and self.pieces.held_bytes > HELD_PIECES_BYTES
            and self.pieces.holds(sender)
        ):
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)
        self._raise_if_ended(sync, version)

    def _wait_for_room(self, sync: _Sync, version: int) -> None:
        nap = 1e-4
        while (
            not sync.future.done() and bucket_files.unread(sync.directory, self.ranks) >= MAX_UNREAD
        ):
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)
        self._raise_if_ended(sync, version)

    def _raise_if_ended(self, sync: _Sync, version: int) -> None:
        """The engine's call ended while buckets still come: an error (the engine died, a name it
        does not know, no bucket for ``idle_timeout_s``)."""
        if sync.future.done():
            sync.done.wait()
            raise RuntimeError(
                f"the rollout engine failed to load weights version {version}: "
                f"{type(sync.error).__name__}: {sync.error}"
            ) from sync.error
