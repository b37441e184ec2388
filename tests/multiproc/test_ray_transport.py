"""RayTransport's and CollectiveTransport's pipelines, on Ray actors that stand in for the engines
(each load takes a fixed time).

Checks the contract sync_model_to_rollout relies on: buckets arrive in the order sent, at most two
are in flight (bucket k is taken before bucket k+2 is put), flush ends the sync once (finish_weights)
after all of them, and an engine's failure or silence surfaces naming that engine. CollectiveTransport
(broadcasts over gloo): intact buckets, pieces included, whichever engine thread takes which bucket,
one group per sender kept across syncs, a failure named and a new group after it. The real engines:
tests/e2e/test_sync_to_rollout.py.
"""

import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from rlmega.sync import collective  # noqa: E402
from rlmega.sync.collective import CollectiveTransport  # noqa: E402
from rlmega.sync.pieces import Piece  # noqa: E402
from rlmega.sync.transports import RayTransport  # noqa: E402

LOAD_S = 0.3


class RemoteEngine:
    """An engine on another node: RayTransport's buckets come through the object store."""

    def begin_weights(self, version: int, sender, nbytes_hint: int) -> dict:
        return {"node": "elsewhere", "directory": "", "ranks": [], "layers": ([], {}, {})}


class SlowEngine(RemoteEngine):
    """Takes ``delay`` seconds per bucket; fails on a bucket holding ``fail_on``."""

    def __init__(self, delay: float = LOAD_S, fail_on: str | None = None):
        self.delay, self.fail_on, self.calls = delay, fail_on, []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        start = time.time()
        names = [n for n, _ in named_tensors]
        if self.fail_on in names:
            raise ValueError(f"cannot load {self.fail_on}")
        time.sleep(self.delay)
        self.calls.append(
            {
                "first": names[0],
                "version": version,
                "start": start,
                "end": time.time(),
                "sum": float(sum(t.sum() for _, t in named_tensors)),
            }
        )

    def finish_weights(self, version: int, sender) -> None:
        self.calls.append({"finish": version, "end": time.time()})

    def log(self) -> list[dict]:
        return [c for c in self.calls if "finish" not in c]

    def finishes(self) -> list[dict]:
        return [c for c in self.calls if "finish" in c]


class KeepingEngine(RemoteEngine):
    """Keeps a copy of every tensor it is sent (what the engine's weight loader would read)."""

    def __init__(self):
        self.got = []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        self.got += [(n, t.clone()) for n, t in named_tensors]

    def finish_weights(self, version: int, sender) -> None:
        pass

    def received(self) -> list:
        return self.got


class BroadcastEngine(KeepingEngine):
    """Receives buckets by broadcast as RolloutWorker does (join_weight_group, receive_broadcast); its
    loads take ``delay`` s, so the engine's threads take the buckets in flight at once; with ``stagger``
    an even bucket's thread starts late, so the next bucket's reaches the group first; fails on a
    bucket holding ``fail_on``."""

    def __init__(self, delay: float = 0.0, fail_on: str | None = None, stagger: bool = False):
        super().__init__()
        self.delay, self.fail_on, self.stagger, self.joins, self.finished = (
            delay,
            fail_on,
            stagger,
            0,
            [],
        )

    def join_weight_group(self, name, host, port, rank, world, backend, timeout_s) -> None:
        collective.join(name, host, port, rank, world, backend, timeout_s)
        self.joins += 1

    def receive_broadcast(self, name, seq, toc, version, sender, timeout_s) -> None:
        if self.stagger and seq % 2 == 0:
            time.sleep(0.2)
        bucket = collective.receive(name, seq, toc, timeout_s)
        if self.fail_on in [n for n, _ in bucket]:
            raise ValueError(f"cannot load {self.fail_on}")
        time.sleep(self.delay)
        self.receive_weights(
            [(n, t.tensor.clone() if isinstance(t, Piece) else t) for n, t in bucket],
            version,
            sender,
        )

    def finish_weights(self, version: int, sender) -> None:
        self.finished.append(version)

    def state(self) -> dict:
        return {
            "joins": self.joins,
            "finished": self.finished,
            "got": self.got,
            "groups": len(collective._joined),
        }


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' code travels by value
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.remote(num_cpus=0.1)(SlowEngine)
    ray.shutdown()


def _buckets(n: int):
    return [
        [(f"b{k}.weight", torch.full((4, 4), float(k))), (f"b{k}.bias", torch.ones(4))]
        for k in range(n)
    ]


def test_buckets_pipeline_two_deep_in_order_and_flush_waits(cluster):
    engines = [cluster.remote() for _ in range(2)]
    transport = RayTransport(engines)
    returned = {}
    for version in (1, 2):  # two syncs back to back, as the driver makes them
        for k, bucket in enumerate(_buckets(5)):
            transport.send(bucket, version)
            returned[version, k] = time.time()
        transport.flush()
        flushed = time.time()
        logs = ray.get([e.log.remote() for e in engines])
        for log in logs:
            calls = [c for c in log if c["version"] == version]
            # in order, all
            assert [c["first"] for c in calls] == [f"b{k}.weight" for k in range(5)]
            assert [c["sum"] for c in calls] == [16.0 * k + 4.0 for k in range(5)]  # intact
            assert flushed >= calls[-1]["end"]
            # Pipelined: sending bucket 0 did not wait for its load ...
            assert returned[version, 0] < calls[0]["end"]
            # ... but bucket k was only put once bucket k-2 had loaded (at most two in flight).
            for k in range(2, 5):
                assert returned[version, k] >= calls[k - 2]["end"], (version, k)
    logs = ray.get([e.log.remote() for e in engines])
    assert all([c["version"] for c in log] == [1] * 5 + [2] * 5 for log in logs)
    # One finish per sync (the engine's one reload ends there), after that sync's buckets.
    for log, fin in zip(logs, ray.get([e.finishes.remote() for e in engines])):
        assert [f["finish"] for f in fin] == [1, 2]
        assert fin[0]["end"] >= log[4]["end"] and fin[1]["end"] >= log[9]["end"]


def test_each_copy_of_a_transport_is_its_own_sender():
    """A sync's senders (one per pipeline stage) each get a pickled copy of the driver's transport; the
    engine keeps its reload open until every sender has finished, so their keys must differ."""
    import pickle

    transport = RayTransport([])
    first = transport.sender
    copies = [pickle.loads(pickle.dumps(transport)) for _ in range(2)]
    keys = {first, *(c.sender for c in copies)}
    assert len(keys) == 3 and transport.sender == first  # stable within a copy


def test_an_engine_failure_surfaces_naming_the_engine(cluster):
    engines = [cluster.remote(delay=0.01), cluster.remote(delay=0.01, fail_on="b1.bias")]
    transport = RayTransport(engines)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)rollout engine 1 failed to load .*'b1.weight'.*version 3.*cannot load b1.bias",
    ):
        for bucket in _buckets(4):
            transport.send(bucket, 3)
        transport.flush()


def test_an_engine_that_does_not_answer_times_out_naming_the_engine(cluster):
    engines = [cluster.remote(delay=5.0)]
    ray.get(engines[0].log.remote())  # started (the sync's first call, begin_weights, is timed too)
    transport = RayTransport(engines, timeout_s=0.5)
    transport.send(_buckets(1)[0], 1)
    with pytest.raises(
        TimeoutError, match=r"rollout engine 0 did not load .*'b0.weight'.*within 0.5 s"
    ):
        transport.flush()


def test_sent_views_of_a_flat_buffer_arrive_intact_and_the_buffer_stays_releasable(cluster):
    """At TP 1 on CPU the bucket's tensors are views of the policy's flat parameter buffer (bf16 and
    fp32 here, one tensor not contiguous, one empty). Sending them must not pin that buffer: the
    colocated release resizes its storage to 0 right after the sync (rlmega.megatron.offload).
    Tensor.numpy() pinned it for good ("Trying to resize storage that is not resizable")."""
    from rlmega.megatron import offload

    gen = torch.Generator().manual_seed(0)
    flat, flat16 = (
        torch.randn(1000, generator=gen),
        torch.randn(300, generator=gen).to(torch.bfloat16),
    )
    bucket = [
        ("w", flat[100:400].view(20, 15)),
        ("wt", flat[:600].view(20, 30).t()),
        ("n", flat16[10:42]),
        ("empty", flat[0:0].view(0, 4)),
    ]
    engine = ray.remote(num_cpus=0.1)(KeepingEngine).remote()
    transport = RayTransport([engine])
    transport.send(bucket, 1)
    transport.flush()
    got = ray.get(engine.received.remote())
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (name, sent), (_, t) in zip(bucket, got):  # same values, dtype and shape, bit for bit
        assert t.dtype == sent.dtype and t.shape == sent.shape and torch.equal(t, sent), name
    expected = flat.clone(), flat16.clone()
    saved = offload.offload_tensors([flat, flat16])  # raised before the fix
    assert flat.untyped_storage().nbytes() == flat16.untyped_storage().nbytes() == 0
    offload.onload_tensors(saved)
    assert torch.equal(flat, expected[0]) and torch.equal(flat16, expected[1])


def _mixed_bucket(k: int):
    """float32, bf16, int64, a non-contiguous view, an empty tensor and a TP rank's piece."""
    gen = torch.Generator().manual_seed(k)
    base = torch.randn(6, 5, generator=gen)
    return [
        (f"b{k}.w", base),
        (f"b{k}.t", base.t()),
        (f"b{k}.h", torch.randn(7, generator=gen).bfloat16()),
        (f"b{k}.i", torch.arange(5) * k),
        (f"b{k}.e", torch.zeros(0, 3)),
        (f"b{k}.p", Piece(torch.randn(2, 5, generator=gen), (4, 5), 0, 2, 2)),
    ]


def test_collective_buckets_arrive_intact_in_one_group_per_sender_kept_across_syncs(cluster):
    # threaded, as Roles starts engines
    Engine = ray.remote(num_cpus=0.1, max_concurrency=4)(BroadcastEngine)
    engines = [Engine.remote(delay=0.05, stagger=True) for _ in range(2)]
    transport = CollectiveTransport(engines)
    sent = []
    for version in (1, 2):
        for k in range(5):
            bucket = _mixed_bucket(10 * version + k)
            transport.send(bucket, version)
            sent += bucket
        transport.flush()
    for state in ray.get([e.state.remote() for e in engines]):
        assert state["joins"] == 1 and state["finished"] == [1, 2]  # one group for both syncs
        got = dict(state["got"])
        assert sorted(got) == sorted(n for n, _ in sent)  # every tensor, once
        for name, t in sent:
            t = t.tensor if isinstance(t, Piece) else t
            assert (
                got[name].dtype == t.dtype
                and got[name].shape == t.shape
                and torch.equal(got[name], t)
            ), name


def test_collective_failure_names_the_engine_and_the_next_sync_makes_a_new_group(cluster):
    Engine = ray.remote(num_cpus=0.1, max_concurrency=4)(BroadcastEngine)
    engines = [Engine.remote(), Engine.remote(fail_on="b1.w")]
    transport = CollectiveTransport(engines, timeout_s=30)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)rollout engine 1 failed to load .*'b1.w'.*version 3.*cannot load b1.w",
    ):
        for k in range(4):
            transport.send(_mixed_bucket(k), 3)
        transport.flush()
    ray.get(engines[1].__ray_call__.remote(lambda self: setattr(self, "fail_on", None)))
    for k in range(3):
        # new values and names
        transport.send([(n.replace("b", "c", 1), t) for n, t in _mixed_bucket(100 + k)], 4)
    transport.flush()
    for state in ray.get([e.state.remote() for e in engines]):
        # a new group for the second sync; the engine retired the first (one group left, not two)
        assert state["joins"] == 2 and state["finished"] == [4] and state["groups"] == 1
        got = dict(state["got"])
        for k in range(3):
            assert torch.equal(got[f"c{100 + k}.w"], _mixed_bucket(100 + k)[0][1])


def test_flatten_keeps_each_tensors_bytes_and_refuses_a_bucket_on_two_devices():
    bucket = _mixed_bucket(3)
    flat, toc = collective.flatten(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == collective.nbytes_of(toc)
    assert all(offset % 64 == 0 for _, _, _, offset, _ in toc)
    back = collective.unflatten(flat, toc)
    for (n, t), (m, u) in zip(bucket, back):
        assert n == m and type(t) is type(u)
        t, u = (t.tensor, u.tensor) if isinstance(t, Piece) else (t, u)
        assert u.dtype == t.dtype and torch.equal(u, t)
    assert (back[-1][1].full_shape, back[-1][1].dim, back[-1][1].start, back[-1][1].of) == (
        (4, 5),
        0,
        2,
        2,
    )
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="several devices"):
        collective.flatten([("a", torch.ones(3)), ("b", meta)])


def test_collective_sync_that_did_not_flush_leaves_its_group_to_a_new_one(cluster):
    """A rank that failed between its sends never flushed: the engines may be out of step with its group."""
    Engine = ray.remote(num_cpus=0.1, max_concurrency=4)(BroadcastEngine)
    engines = [Engine.remote()]
    first = CollectiveTransport(engines)
    first.send(_mixed_bucket(0), 1)
    ray.get(first._in_flight[0][0])  # received, never flushed
    # the next sync's copy of the same transport, in the same process
    again = CollectiveTransport(engines)
    again.key = first.key
    again.send(_mixed_bucket(1), 2)
    again.flush()
    state = ray.get(engines[0].state.remote())
    assert state["joins"] == 2 and state["groups"] == 1 and state["finished"] == [2]
    assert torch.equal(dict(state["got"])["b1.w"], _mixed_bucket(1)[0][1])
