"""The shared-memory bucket files a RolloutWorker hands its engine (rlmega/sync/bucket_files.py):
bytes round trip exactly (any dtype, shape, order, empty or non-contiguous tensors) as aligned views of
the file, every rank reads each bucket, files go once read, the stream ends at END and gives up on a
silent sender. No engine: the engine's side is tests/e2e/test_rollout_worker.py."""

import os
import threading
import time

import pytest
import torch

from rlmega.sync import bucket_files


@pytest.fixture
def sync_dir():
    import shutil

    d = bucket_files.open_sync_dir([0, 1], 1 << 20)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _bucket():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=g)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.weight", flat[:600].view(20, 30).t()),  # not contiguous
        ("d.empty", flat[0:0].view(0, 4)),
        ("e.int", torch.arange(5, dtype=torch.int64)),
        ("f.half", torch.randn(3, generator=g).half()),
    ]


def test_a_bucket_reads_back_bit_for_bit_as_aligned_views_in_every_rank(sync_dir):
    sent = _bucket()
    nbytes = bucket_files.write_bucket(sync_dir, 3, sent, [0, 1])
    assert nbytes == sum(t.nbytes for _, t in sent)
    assert sorted(os.listdir(sync_dir)) == ["0", "1"]  # the first name is gone, one link per rank
    assert bucket_files.unread(sync_dir, [0, 1]) == 1
    for rank in (0, 1):
        path = os.path.join(sync_dir, str(rank), "00000003.bin")
        got = bucket_files.read_bucket(path)
        assert [n for n, _ in got] == [n for n, _ in sent]
        for (name, t), (_, s) in zip(got, sent):
            assert t.dtype == s.dtype and t.shape == s.shape and torch.equal(t, s), name
            assert t.data_ptr() % 64 == 0 or t.numel() == 0, name  # aligned views of the mapping
        got[0][1][0, 0] = 99.0  # a private mapping: writing does not reach the file
        assert bucket_files.read_bucket(path)[0][1][0, 0] == sent[0][1][0, 0]
        os.unlink(path)
    assert bucket_files.unread(sync_dir, [0, 1]) == 0


def test_the_stream_reads_buckets_as_they_come_until_the_end(sync_dir):
    sent = _bucket()
    got, waited = [], [0.0]

    def read():
        got.extend(
            (n, t.clone())
            for n, t in bucket_files.read_stream(sync_dir, 1, idle_timeout_s=30, waited=waited)
        )

    reader = threading.Thread(target=read)
    reader.start()
    for seq in range(3):
        time.sleep(0.05)  # the reader waits for each
        bucket_files.write_bucket(sync_dir, seq, [(f"{seq}.{n}", t) for n, t in sent], [0, 1])
    bucket_files.end(sync_dir)
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert [n for n, _ in got] == [f"{seq}.{n}" for seq in range(3) for n, _ in sent]
    assert all(torch.equal(t, sent[i % len(sent)][1]) for i, (_, t) in enumerate(got))
    assert os.listdir(os.path.join(sync_dir, "1")) == []  # each read, then unlinked
    assert len(os.listdir(os.path.join(sync_dir, "0"))) == 3  # rank 0 has not read its links
    assert waited[0] > 0.05


def test_a_silent_sender_times_the_stream_out(sync_dir):
    with pytest.raises(TimeoutError, match="no weight bucket for 0.2 s"):
        list(bucket_files.read_stream(sync_dir, 0, idle_timeout_s=0.2))


def test_a_dead_owners_sync_directories_are_found_by_its_pid(sync_dir):
    assert sync_dir in bucket_files.staged_by(os.getpid())
    assert os.path.basename(sync_dir).startswith(f"rlmega-weights-{os.getpid()}-")
    assert bucket_files.staged_by(os.getpid() + 1_000_000) == []
