"""Weight buckets as files in shared memory: how a RolloutWorker hands tensors to its engine's model process.

The model lives in another process (vLLM's engine core, or its workers at TP > 1), and arguments of
``collective_rpc`` cross as msgpack, so tensors go as files in /dev/shm (RAM, not disk). One weight sync
is one directory, ``<shm>/rlmega-weights-<owner pid>-<uuid>/``, with a folder per model worker (its
rank). A bucket is written once (``write_bucket``), hard-linked into every worker's folder, and its
first name dropped: each worker reads its link as views of the file's mapping (no copy; ``read_bucket``)
and unlinks it, so tmpfs frees the bucket once every worker has read it and vLLM has let go of the
views. A file ``END`` in the directory says no bucket follows (``read_stream`` returns).

The format is this module's own: 8 bytes little-endian header length, a JSON header
``[[name, dtype, shape, offset, nbytes], ...]``, then each tensor's bytes at a 64-byte aligned offset
(a view of any dtype needs its offset aligned; safetensors packs tensors without gaps, and its
``save_file`` copies each tensor to ``bytes`` once more before writing).

A bucket written into a shared-memory slot kept across syncs (rlmega/sync/shm_slots.py: no new
pages to fault in and free each sync) is handed over the same way as a ticket, ``<seq>.slot``, naming
the slot; a file here is the fallback when no slot can take the bucket.

A bucket of CUDA IPC records (rlmega/sync/cuda_ipc.py) is an ``.ipc`` file instead: the records,
pickled (the sync directory is private to this node's RolloutWorker and its engine); the reader
rebuilds each tensor over the sender's GPU memory.

A dead owner's directories are removed by the engine (``staged_by``, used by ``rlmega_watch_owner``).

Both writers of a sync directory follow one hand-over, so its sizes live here, below both: the
RolloutWorker's WeightStream (rlmega/rollout/weight_stream.py) and a trainer rank on the engine's
node writing its own buckets (rlmega/sync/local_slots.py) cut whole layers into files of about
``FILE_BYTES`` (``files_of_layers``; also the size of a shared-memory slot) and wait while
``MAX_UNREAD`` of them are unread (``unread``). They were the engine side's constants; the trainer
side importing them from there made rlmega/sync and the engine side import each other.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import mmap
import os
import pickle
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from rlmega.sync.cuda_ipc import IpcTensor
from rlmega.sync.pieces import Assembled
from rlmega.sync.byte_views import byte_array

SHM = "/dev/shm"
PREFIX = "rlmega-weights-"  # + owner pid: what rlmega_watch_owner removes when the owner dies
END = "END"
# a bucket in a shared-memory slot (shm_slots.py): handed over, read and still viewed
TICKET, HELD = ".slot", ".held"
_ALIGN = 64
MADV_POPULATE_READ = 22  # linux/mman.h; Python's mmap module does not name it

# Files of a few tens of MB: the engine starts on the first within ~10 ms (write ~0.35 s/GB here), and a
# file costs a link, a map and an unlink (~0.1 ms). Measured on the 0.4 GB benchmark model, TP1: 32 MiB
# files gave the same sync time as 16 MiB and 64 MiB within noise.
FILE_BYTES = 32 << 20
MAX_UNREAD = 2  # files written and not yet read by every model worker; a writer waits for room


def open_sync_dir(ranks: list[int], nbytes_hint: int) -> str:
    """A new, empty sync directory with one folder per rank; /dev/shm when it has room.

    Docker gives a container 64 MB of /dev/shm by default: with less than three buckets'
    (``nbytes_hint``) room, the temporary directory, whose page cache then serves the reader.
    """
    base = tempfile.gettempdir()
    if os.path.isdir(SHM) and shutil.disk_usage(SHM).free > 3 * nbytes_hint + (64 << 20):
        base = SHM
    directory = os.path.join(base, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    for rank in ranks:
        os.makedirs(os.path.join(directory, str(rank)))
    return directory


def files_of_layers(groups: list[list[tuple[str, Any]]], limit: int):
    """Consecutive whole layers in lists of about ``limit`` bytes (a bigger layer goes alone)."""
    chunk, size = [], 0
    for group in groups:
        nbytes = sum(t.nbytes for _, t in group)  # (a tensor's, or a CUDA IPC record's)
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk += group
        size += nbytes
    if chunk:
        yield chunk


def write_bucket(
    directory: str,
    seq: int,
    named_tensors: list[tuple[str, torch.Tensor]],
    ranks: list[int],
    tag: str = "",
) -> int:
    """Write one bucket (file ``seq``) and hand it to every rank's folder; returns its tensor bytes.

    The tensors' bytes are written straight from their memory (an object-store view, a trainer's
    parameter: ``byte_array`` leaves its storage resizable). A folder's link appears only once the
    file is whole, so a reader never sees half a bucket.
    """
    if is_ipc(named_tensors):  # CUDA IPC records, not bytes
        hand_over(directory, f"{seq:08d}{tag}.ipc", pickle.dumps(named_tensors), ranks)
        return sum(t.nbytes for _, t in named_tensors)
    head, start, parts, _ = layout(named_tensors)

    def write(f):
        f.write(head)
        for t, off in parts:
            if t.nbytes:
                f.seek(start + off)
                f.write(byte_array(t.tensor() if isinstance(t, Assembled) else t))

    hand_over(directory, f"{seq:08d}{tag}.bin", write, ranks)
    return sum(t.nbytes for t, _ in parts)


def is_ipc(named_tensors: list) -> bool:
    """A bucket of CUDA IPC records (rlmega/sync/cuda_ipc.py), not tensors."""
    return bool(named_tensors) and isinstance(named_tensors[0][1], IpcTensor)


def layout(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> tuple[bytes, int, list[tuple[torch.Tensor, int]], int]:
    """A bucket in this module's format: (its first bytes: header length and header, where the data
    starts, [(tensor on the CPU, contiguous, or an Assembled one; its offset from the data's start)],
    the bucket's size)."""
    tensors = [
        (n, t if isinstance(t, Assembled) else t.detach().to("cpu").contiguous())
        for n, t in named_tensors
    ]
    header, offset = [], 0
    for name, t in tensors:
        header.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.nbytes])
        offset = -(-(offset + t.nbytes) // _ALIGN) * _ALIGN
    head = json.dumps(header).encode()
    start = -(-(8 + len(head)) // _ALIGN) * _ALIGN  # data offsets count from here
    parts = [(t, h[3]) for (_, t), h in zip(tensors, header)]
    return len(head).to_bytes(8, "little") + head, start, parts, start + offset


def hand_over(directory: str, name: str, content, ranks: list[int]) -> None:
    """Write a file (``content``: bytes, or a function of the open file), then link it into each rank's folder."""
    path = os.path.join(directory, name)
    with open(path, "wb", buffering=0) as f:
        if isinstance(content, bytes):
            f.write(content)
        else:
            content(f)
    for rank in ranks:
        os.link(path, os.path.join(directory, str(rank), name))
    os.unlink(path)


def read_bucket(path: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one bucket file, as views of its mapping (private: a write would not reach the file)."""
    with open(path, "rb") as f:
        # Private and writable: torch wants a writable buffer, and a loader that wrote into its input
        # would write to a private copy of that page (a read-only mapping would crash it).
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # Map every page now, in one go (32 MiB: 4 ms here, against 14 ms for faulting them in one by one
    # as vLLM reads); MAP_POPULATE would instead copy each page of a private writable mapping (14 ms).
    with contextlib.suppress(OSError, ValueError):  # MADV_POPULATE_READ: Linux 5.14+
        m.madvise(MADV_POPULATE_READ)
    # holds the mapping alive as long as a view does
    return views(m, torch.frombuffer(m, dtype=torch.uint8))


def views(buffer, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the bucket in ``buffer`` (an mmap), as views of ``data``: its bytes as one uint8 tensor."""
    n = int.from_bytes(buffer[:8], "little")
    header = json.loads(buffer[8 : 8 + n])
    start = -(-(8 + n) // _ALIGN) * _ALIGN
    return [
        (name, data[start + off : start + off + nbytes].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, off, nbytes in header
    ]


def unread(directory: str, ranks: list[int]) -> int:
    """Buckets some rank has not read yet (a ``HELD`` ticket has been read)."""
    return len(
        set(itertools.chain.from_iterable(_unread(os.path.join(directory, str(r))) for r in ranks))
    )


def _unread(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.endswith(HELD))


def end(directory: str) -> None:
    """No bucket follows: the readers return once they have read what is there."""
    open(os.path.join(directory, END), "w").close()


def read_stream(
    directory: str, rank: int, idle_timeout_s: float, waited: list[float] | None = None, slots=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every bucket handed to ``rank``, as the buckets arrive, until ``END``.

    Each file is unlinked once its tensors are handed on; a ``TICKET`` (a bucket in a shared-memory
    slot) goes to ``slots`` (rlmega/sync/shm_slots.py ``SlotReader``), which removes it once the
    reload holds none of its tensors. Raises TimeoutError after ``idle_timeout_s`` without a bucket or
    ``END`` (a sender that died mid-sync must not hold the engine forever). ``waited[0]`` grows by the
    seconds spent waiting for buckets.
    """
    mine = os.path.join(directory, str(rank))
    last, nap = time.monotonic(), 1e-4
    waited = [0.0] if waited is None else waited
    while True:
        names = _unread(mine)
        for name in names:
            path = os.path.join(mine, name)
            if name.endswith(TICKET):
                if slots is None:
                    raise RuntimeError(
                        f"{path}: a bucket in a shared-memory slot, and no slot reader here"
                    )
                yield from slots.read(path)
                slots.release()  # (the loader's loop still holds the last tensor: released later)
                continue
            if name.endswith(".ipc"):  # CUDA IPC records: tensors over the sender's GPU memory
                with open(path, "rb") as f:
                    yield from ((n, record.open()) for n, record in pickle.load(f))
            else:
                yield from read_bucket(path)
            os.unlink(path)
        if names:
            last, nap = time.monotonic(), 1e-4
            continue
        # END is written after the last bucket is linked, so an empty folder seen after END is final.
        if os.path.exists(os.path.join(directory, END)):
            if not _unread(mine):
                return
            continue
        if time.monotonic() - last > idle_timeout_s:
            raise TimeoutError(
                f"no weight bucket for {idle_timeout_s:g} s and no end of the sync ({directory})"
            )
        if slots is not None:
            slots.release()  # the writer may be waiting for a slot the reload has let go of
        t0 = time.monotonic()
        time.sleep(nap)
        waited[0] += time.monotonic() - t0
        nap = min(2 * nap, 2e-3)  # waiting costs a few wake-ups per ms at most


def staged_by(pid: int) -> list[str]:
    """Sync directories a process made (in either place ``open_sync_dir`` puts them)."""
    return [
        p
        for d in (SHM, tempfile.gettempdir())
        for p in glob.glob(os.path.join(d, f"{PREFIX}{pid}-*"))
    ]
