"""Shared-memory slots kept across weight syncs (rlmega/sync/shm_slots.py): a second sync through
the same slots gives the reader exactly the second weights, with no new slot nor mapping, and no slot
has a name in /dev/shm after its first sync; a slot any tensor of which is still alive in the reader
is never refilled (while held in a reload, nor after it: retired); a failed sync's slots are dropped;
a full pool or a small /dev/shm falls back to bucket files. No engine: the engine's side is
tests/e2e/test_rollout_worker.py."""

import glob
import os
import shutil
import threading

import pytest
import torch

from rlmega.sync import bucket_files, shm_slots

MB = 1 << 20


@pytest.fixture
def pool():
    p = shm_slots.SlotPool(file_bytes=MB)
    yield p
    p.close()


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(64, 64, generator=g)),
        ("b.bias", torch.randn(7, generator=g).bfloat16()),
        ("c.weight", torch.randn(40, 30, generator=g).t()),
        ("d.empty", torch.zeros(0, 4)),
        ("e.int", torch.arange(5) + seed),
    ]


def _sync(pool, readers, buckets, ranks=(0, 1)):
    """One sync as WeightStream and rlmega_load_stream run it: every bucket written into the pool (a
    file when it has no slot), each rank's stream read to its end as a loader does (its loop holds
    the last tensor), the reload ends, then the writer ends the sync and removes its directory."""
    d = bucket_files.open_sync_dir(list(ranks), MB)
    try:
        for seq, bucket in enumerate(buckets):
            if pool.write(d, seq, bucket, list(ranks)) is None:
                bucket_files.write_bucket(d, seq, bucket, list(ranks))
        bucket_files.end(d)
        got = {}
        for rank in ranks:
            got[rank] = [
                (n, t.clone()) for n, t in bucket_files.read_stream(d, rank, 5, slots=readers[rank])
            ]
            readers[rank].finish()
        pool.end_sync(d, failed=False)
        return got
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _slot_files():
    return [
        p
        for p in glob.glob(
            f"{bucket_files.SHM}/{bucket_files.PREFIX}{os.getpid()}-*/{shm_slots.SLOT}*"
        )
    ]


def _equal(got, sent):
    return [n for n, _ in got] == [n for n, _ in sent] and all(
        g.dtype == s.dtype and g.shape == s.shape and torch.equal(g, s)
        for (_, g), (_, s) in zip(got, sent)
    )


def test_a_second_sync_through_the_same_slots_gives_exactly_the_second_weights(pool):
    readers = {0: shm_slots.SlotReader(), 1: shm_slots.SlotReader()}
    first = [[(f"{k}.{n}", t) for n, t in _weights(k)] for k in range(3)]
    second = [[(f"{k}.{n}", t) for n, t in _weights(10 + k)] for k in range(3)]
    got = _sync(pool, readers, first)
    assert all(_equal(got[r], sum(first, [])) for r in (0, 1))
    slots, maps = list(pool._slots), {r: dict(readers[r]._maps) for r in (0, 1)}
    assert len(slots) == 3  # nothing freed before the reads: one slot per bucket
    assert _slot_files() == []  # no name left: the memory lives in the mappings only
    got = _sync(pool, readers, second)
    assert all(_equal(got[r], sum(second, [])) for r in (0, 1))
    assert pool._slots == slots  # the same slots ...
    assert all(readers[r]._maps == maps[r] for r in (0, 1))  # ... each mapped once per reader
    assert _slot_files() == []


def test_a_slot_still_viewed_is_not_refilled_until_its_tensors_go(pool):
    reader = shm_slots.SlotReader()
    d = bucket_files.open_sync_dir([0], MB)
    try:
        a, b, c = (_weights(k) for k in range(3))
        pool.write(d, 0, a, [0])
        # a layer held to the end
        kept = dict(reader.read(os.path.join(d, "0", "00000000.slot")))["a.weight"]
        reader.release()
        assert os.listdir(os.path.join(d, "0")) == ["00000000.held"]
        assert bucket_files.unread(d, [0]) == 0  # read: the writer's flow control goes on
        pool.write(d, 1, b, [0])
        assert len(pool) == 2  # the held slot was not taken
        assert torch.equal(kept, a[0][1])
        b_views = reader.read(os.path.join(d, "0", "00000001.slot"))
        assert _equal([(n, t.clone()) for n, t in b_views], b)
        del b_views
        reader.release()
        assert os.listdir(os.path.join(d, "0")) == ["00000000.held"]  # b's slot is free again
        pool.write(d, 2, c, [0])
        assert len(pool) == 2 and torch.equal(kept, a[0][1])  # c went into b's slot
        del kept
        reader.release()
        # a's ticket gone with its last view
        assert os.listdir(os.path.join(d, "0")) == ["00000002.slot"]
    finally:
        reader.finish()
        shutil.rmtree(d, ignore_errors=True)


def test_a_slot_viewed_after_the_reload_is_retired_never_refilled(pool):
    reader = shm_slots.SlotReader()
    d = bucket_files.open_sync_dir([0], MB)
    try:
        pool.write(d, 0, _weights(0), [0])
        bucket_files.end(d)
        # a leak past the reload
        kept = [t for _, t in bucket_files.read_stream(d, 0, 5, slots=reader)]
        reader.finish()
        assert len(pool) == 1 and not pool._slots[0].free()  # retired ...
        pool.end_sync(d, failed=False)
        # ... and forgotten; the pages stay with the views
        assert len(pool) == 0 and reader._maps == {}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    got = _sync(pool, {0: reader}, [_weights(1)], ranks=(0,))
    assert _equal(got[0], _weights(1)) and len(pool) == 1
    assert all(torch.equal(k, s) for k, (_, s) in zip(kept, _weights(0)))


def test_a_writer_in_another_process_learns_the_retired_slots_from_the_marks_it_is_given(pool):
    """A trainer rank writing an engine's slots (rlmega/sync/local_slots.py) ends its sync after the
    engine removed the directory: it gets the readers' retired-<id> marks (finish_weights) instead."""
    reader = shm_slots.SlotReader()
    d = bucket_files.open_sync_dir([0], MB)
    try:
        pool.write(d, 0, _weights(0), [0], tag="-sender")
        # its writer's mark in the name
        assert os.listdir(os.path.join(d, "0")) == ["00000000-sender.slot"]
        pool.write(d, 1, _weights(1), [0], tag="-sender")
        bucket_files.end(d)
        kept = [t for n, t in bucket_files.read_stream(d, 0, 5, slots=reader) if n == "a.weight"][
            :1
        ]
        reader.finish()  # the first bucket's slot is still viewed: retired
        marks = [n for n in os.listdir(d) if n.startswith(shm_slots.RETIRED)]
        assert len(marks) == 1 and len(pool) == 2
    finally:
        shutil.rmtree(d, ignore_errors=True)
    pool.end_sync(d, failed=False, retired=marks)
    assert len(pool) == 1  # the retired one dropped, the other kept for the next sync
    got = _sync(pool, {0: reader}, [_weights(2)], ranks=(0,))
    assert _equal(got[0], _weights(2)) and torch.equal(kept[0], _weights(0)[0][1])


def test_slots_are_taken_back_while_a_stream_is_read(pool):
    """Writer and reader at once, as in a sync: slots come back as the loader moves on, so a few serve many buckets."""
    reader = shm_slots.SlotReader()
    d = bucket_files.open_sync_dir([0], MB)
    sent = [[(f"{k}.{n}", t) for n, t in _weights(k)] for k in range(12)]
    got = []
    thread = threading.Thread(
        target=lambda: got.extend(
            (n, t.clone()) for n, t in bucket_files.read_stream(d, 0, 30, slots=reader)
        )
    )
    thread.start()
    try:
        for seq, bucket in enumerate(sent):
            while bucket_files.unread(d, [0]) >= 2:  # bucket_files.MAX_UNREAD
                pass
            assert pool.write(d, seq, bucket, [0]) is not None
        bucket_files.end(d)
        thread.join(30)
        assert not thread.is_alive() and _equal(got, sum(sent, []))
        assert len(pool) <= 5
    finally:
        reader.finish()
        shutil.rmtree(d, ignore_errors=True)


def test_a_full_pool_or_a_small_shm_falls_back_to_files(monkeypatch):
    small = shm_slots.SlotPool(file_bytes=MB, cap_bytes=MB)
    buckets = [[(f"{k}.{n}", t) for n, t in _weights(k)] for k in range(3)]
    got = _sync(small, {0: shm_slots.SlotReader()}, buckets, ranks=(0,))
    assert _equal(got[0], sum(buckets, [])) and len(small) == 1  # one slot, then files
    # Docker's 64 MB /dev/shm: no slot
    monkeypatch.setattr(
        shm_slots.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(64 * MB, 0, 64 * MB)
    )
    docker = shm_slots.SlotPool(file_bytes=MB)
    d = bucket_files.open_sync_dir([0], MB)
    try:
        assert docker.write(d, 0, _weights(0), [0]) is None and len(docker) == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_failed_syncs_slots_are_dropped(pool):
    readers = {0: shm_slots.SlotReader()}
    _sync(pool, readers, [_weights(0)], ranks=(0,))
    d = bucket_files.open_sync_dir([0], MB)
    try:
        pool.write(d, 0, _weights(1), [0])  # the slot of the first sync, and no reader reads it
        pool.end_sync(d, failed=True)
        assert len(pool) == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
