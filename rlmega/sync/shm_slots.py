"""Shared-memory slots kept across weight syncs: buckets without new pages each time.

Why: a bucket in a new /dev/shm file (bucket_files.write_bucket) costs the writer fresh pages, the
engine a fault per 4 KB page to map them and the kernel a free of each after (/dev/shm has no huge
pages here): vLLM's reload of a sync's buckets from such files took 0.27-0.29 s against 0.14-0.17 s
from memory (0.4 GB model, TP1). A slot is shared memory mapped once by the writer (``SlotPool``, in
the RolloutWorker) and once by each model worker (``SlotReader``), and refilled sync after sync.

No name outlives a sync: a slot is born as a file ``slot-<id>`` in the sync directory of its first
use, every model worker maps it while reading that sync, and the file goes with the directory; the
mappings keep the memory, which the kernel frees when the last process holding one exits, however it
exits (a RolloutWorker and its engine killed together by Ray leave nothing in /dev/shm).

The writer is the RolloutWorker, or a trainer rank on the engine's node writing its own buckets
(rlmega/sync/local_slots.py: a pool per engine in that process; it learns the slots its engine's readers
retired from ``finish_weights``, since the sync directory is gone by then).

Hand-over: the writer fills a free slot (bucket_files' format) and links a ticket ``<seq>.slot``
holding the slot's first path (its id in every reader's map) into every rank's folder of the sync
directory, where the rank's stream reads it in order with any bucket files. A slot is free again once
every rank's ticket is gone, and a rank removes its ticket only when no tensor of its read is alive in
its process (the read's storage has expired): vLLM's layerwise reload keeps the loaded tensors of a
layer it does not process at once until the reload's end (attention layers, layers with padding:
``finalize_layerwise_processing``, vLLM 0.32), and a loader's loop holds its last tensor until the next
arrives. A read still viewed renames its ticket ``<seq>.held`` (read: no longer counted by the writer's
flow control) until its tensors go. A slot still viewed when the reload has ended is retired: the
reader leaves ``retired-<id>`` in the sync directory before removing its ticket, and the writer never
fills that slot again (the views keep their pages). A failed sync's slots are all retired by the
writer (a model worker of a failed reload may still be reading them).

Bounds: the pool grows only when no slot is free, up to ``POOL_BYTES`` and only while /dev/shm keeps
room for the fresh-file path besides (Docker's 64 MB /dev/shm gets no slot); past that a bucket goes
as a new file.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import shutil
import threading
import uuid
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rlmega.sync.pieces import Assembled
from rlmega.sync import bucket_files

# Enough for a few buckets of a few tens of MB in flight and a few held to the reload's end, and for a
# model's largest layer (an embedding) in a slot of its own.
POOL_BYTES = 512 << 20
# in a sync directory: a slot's first path; a reader's word that it is retired
SLOT, RETIRED = "slot-", "retired-"
_MB = 1 << 20


class _Slot:
    def __init__(self, path: str, nbytes: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Pages now: a full /dev/shm fails here (the bucket goes as a file), not as SIGBUS mid-copy.
            os.posix_fallocate(fd, 0, nbytes)
            # holds the mapping
            self.data = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.sync: str | None = None  # the sync directory it was last handed over in
        self.tickets: list[str] = []  # every rank's ticket of that hand-over
        self.writing = False

    def free(self) -> bool:
        # A ticket is renamed <seq>.held at most once, then unlinked: a check of the first name, then
        # of the second, cannot miss one that is moving. A reader retiring the slot marks it before it
        # unlinks the ticket, so the mark is looked for after the tickets: one of the two is seen.
        return (
            not self.writing
            and not any(
                os.path.exists(t)
                or os.path.exists(t.removesuffix(bucket_files.TICKET) + bucket_files.HELD)
                for t in self.tickets
            )
            and not os.path.exists(self.retired_mark())
        )

    def retired_mark(self) -> str:
        return retired_mark(self.sync or "", self.path)


def retired_mark(sync_dir: str, slot_path: str) -> str:
    return os.path.join(sync_dir, RETIRED + os.path.basename(slot_path).removeprefix(SLOT))


class SlotPool:
    """The writer's (RolloutWorker's) slots; thread-safe (a sync's senders write from several threads)."""

    def __init__(self, file_bytes: int, cap_bytes: int = POOL_BYTES, shm: str = bucket_files.SHM):
        """``file_bytes``: the size of a bucket file, when one is written instead (its room is kept)."""
        self.file_bytes, self.cap_bytes, self.shm = file_bytes, cap_bytes, shm
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()

    def write(
        self, directory: str, seq: int, named_tensors: list, ranks: list[int], tag: str = ""
    ) -> int | None:
        """Write a bucket into a free slot and hand it to every rank's folder of sync ``directory``;
        its tensor bytes, or None when no slot can take it (write a file instead). ``tag``: this
        writer's mark in the ticket's name (several processes write into one sync)."""
        if bucket_files.is_ipc(named_tensors):
            return None
        head, start, parts, size = bucket_files.layout(named_tensors)
        slot = self._acquire(size, directory)
        if slot is None:
            return None
        name = f"{seq:08d}{tag}{bucket_files.TICKET}"
        try:
            slot.data[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
            for t, off in parts:
                # TP ranks' blocks, each copied to its place: no copy of its own
                if isinstance(t, Assembled):
                    t.write_into(slot.data[start + off : start + off + t.nbytes])
                elif t.nbytes:
                    slot.data[start + off : start + off + t.nbytes].copy_(
                        t.reshape(-1).view(torch.uint8)
                    )
            # (before the links: a rank that got its ticket holds the slot even if linking the next fails)
            slot.tickets = [os.path.join(directory, str(r), name) for r in ranks]
            bucket_files.hand_over(directory, name, slot.path.encode(), ranks)
        finally:
            with self._lock:
                slot.writing = False
        return sum(t.nbytes for t, _ in parts)

    def _acquire(self, nbytes: int, directory: str) -> _Slot | None:
        with self._lock:
            fits = [s for s in self._slots if s.nbytes >= nbytes and s.free()]
            slot = min(fits, key=lambda s: s.nbytes) if fits else self._grow(nbytes, directory)
            if slot is not None:
                slot.writing, slot.sync, slot.tickets = True, directory, []
            return slot

    def _grow(self, nbytes: int, directory: str) -> _Slot | None:
        # powers of two: a slot serves buckets of similar size
        size = 1 << max(nbytes - 1, _MB - 1).bit_length()
        if sum(s.nbytes for s in self._slots) + size > self.cap_bytes:
            return None
        # only in shared memory (not the temporary directory open_sync_dir falls back to), leaving it the
        # room open_sync_dir wants for bucket files (three buckets and 64 MiB)
        if os.path.dirname(directory) != self.shm or shutil.disk_usage(
            self.shm
        ).free < size + 3 * self.file_bytes + (64 << 20):
            return None
        try:
            slot = _Slot(os.path.join(directory, SLOT + uuid.uuid4().hex), size)
        except OSError:  # no room after all (another process filled /dev/shm meanwhile)
            return None
        self._slots.append(slot)
        return slot

    def end_sync(self, directory: str, failed: bool, retired: list[str] | None = None) -> None:
        """Sync ``directory``'s reload has returned; call before removing the directory, or pass the
        ``retired-<id>`` marks found in it. Drops the slots its readers retired, or, when it failed,
        every slot it used (a model worker of the failed reload may still read them)."""

        def is_retired(s: _Slot) -> bool:
            mark = s.retired_mark()
            return (
                os.path.basename(mark) in retired if retired is not None else os.path.exists(mark)
            )

        with self._lock:
            self._slots = [
                s for s in self._slots if s.sync != directory or not (failed or is_retired(s))
            ]

    def close(self) -> None:
        """Forget every slot (a mapping goes with the last view of it: never unmapped under a writer)."""
        with self._lock:
            self._slots = []

    def __len__(self) -> int:
        return len(self._slots)


class SlotReader:
    """A model worker's side: each slot mapped once (read-only) for the worker's life, and the reads
    of the running reload whose tickets wait for their tensors to go."""

    def __init__(self):
        # a slot's first path (gone after its first sync) -> its mapping
        self._maps: dict[str, mmap.mmap] = {}
        # [ticket path (its current name), StorageWeakRef of the read, slot path]
        self._held: list[list] = []

    def read(self, ticket: str) -> list[tuple[str, torch.Tensor]]:
        """The tensors of the bucket ``ticket`` hands over, as views of the slot's mapping."""
        with open(ticket, "rb") as f:
            slot = f.read().decode()
        m = self._maps.get(slot)
        if m is None:  # the slot's first sync: its file is in this sync's directory
            with open(slot, "rb") as f:
                # Shared: the writer's next bucket in this slot is seen here without mapping it again.
                # Read-only: a loader writing into its input would corrupt what the other ranks read
                # (and the writer's next bucket); a crash says so instead.
                m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with contextlib.suppress(OSError, ValueError):
                m.madvise(bucket_files.MADV_POPULATE_READ)  # once per slot: its pages stay mapped
            self._maps[slot] = m
        with warnings.catch_warnings():  # "not writable": on purpose (above)
            warnings.simplefilter("ignore", UserWarning)
            # a storage per read: its weakref says when it goes
            data = torch.frombuffer(m, dtype=torch.uint8)
        self._held.append([ticket, StorageWeakRef(data.untyped_storage()), slot])
        return bucket_files.views(m, data)

    def release(self) -> None:
        """Remove the ticket of every read no tensor of which is alive; mark the others read (``HELD``)."""
        keep = []
        for entry in self._held:
            ticket, ref, _ = entry
            if ref.expired():
                os.unlink(ticket)
                continue
            if ticket.endswith(bucket_files.TICKET):
                entry[0] = ticket.removesuffix(bucket_files.TICKET) + bucket_files.HELD
                os.rename(ticket, entry[0])
            keep.append(entry)
        self._held = keep

    def finish(self) -> None:
        """The reload has ended (or failed): give every slot back; retire one still viewed."""
        if any(not ref.expired() for _, ref, _ in self._held):
            gc.collect()  # a reference cycle (an exception's frames) may hold the last views
        for ticket, ref, slot in self._held:
            if not ref.expired():
                sync_dir = os.path.dirname(os.path.dirname(ticket))  # <sync>/<rank>/<seq>.held
                # (gone: the sync failed, all its slots retire)
                with contextlib.suppress(FileNotFoundError):
                    open(retired_mark(sync_dir, slot), "w").close()  # before the ticket goes
                self._maps.pop(slot, None)  # (the views hold the mapping as long as they live)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ticket)
        self._held = []
