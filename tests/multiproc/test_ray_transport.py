"""RayTransport's pipeline, on Ray actors that stand in for the engines (each load takes a fixed time).

Checks the contract sync_model_to_rollout relies on: buckets arrive in the order sent, at most two
are in flight (bucket k is taken before bucket k+2 is put), flush ends the sync once (finish_weights)
after all of them, and an engine's failure or silence surfaces naming that engine. The real engines: tests/e2e/test_sync_to_rollout.py.
"""
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from rlmega.sync.transports import RayTransport  # noqa: E402

LOAD_S = 0.3


class SlowEngine:
    """Takes ``delay`` seconds per bucket; fails on a bucket holding ``fail_on``."""

    def __init__(self, delay: float = LOAD_S, fail_on: str | None = None):
        self.delay, self.fail_on, self.calls = delay, fail_on, []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        start = time.time()
        names = [n for n, _ in named_tensors]
        if self.fail_on in names:
            raise ValueError(f"cannot load {self.fail_on}")
        time.sleep(self.delay)
        self.calls.append({"first": names[0], "version": version, "start": start, "end": time.time(),
                           "sum": float(sum(t.sum() for _, t in named_tensors))})

    def finish_weights(self, version: int, sender) -> None:
        self.calls.append({"finish": version, "end": time.time()})

    def log(self) -> list[dict]:
        return [c for c in self.calls if "finish" not in c]

    def finishes(self) -> list[dict]:
        return [c for c in self.calls if "finish" in c]


class KeepingEngine:
    """Keeps a copy of every tensor it is sent (what the engine's weight loader would read)."""

    def __init__(self):
        self.got = []

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        self.got += [(n, t.clone()) for n, t in named_tensors]

    def finish_weights(self, version: int, sender) -> None:
        pass

    def received(self) -> list:
        return self.got


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' code travels by value
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.remote(num_cpus=0.1)(SlowEngine)
    ray.shutdown()


def _buckets(n: int):
    return [[(f"b{k}.weight", torch.full((4, 4), float(k))), (f"b{k}.bias", torch.ones(4))] for k in range(n)]


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
            assert [c["first"] for c in calls] == [f"b{k}.weight" for k in range(5)]  # in order, all
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
    with pytest.raises(RuntimeError, match=r"(?s)rollout engine 1 failed to load .*'b1.weight'.*version 3.*cannot load b1.bias"):
        for bucket in _buckets(4):
            transport.send(bucket, 3)
        transport.flush()


def test_an_engine_that_does_not_answer_times_out_naming_the_engine(cluster):
    engines = [cluster.remote(delay=5.0)]
    transport = RayTransport(engines, timeout_s=0.5)
    transport.send(_buckets(1)[0], 1)
    with pytest.raises(TimeoutError, match=r"rollout engine 0 did not load .*'b0.weight'.*within 0.5 s"):
        transport.flush()


def test_sent_views_of_a_flat_buffer_arrive_intact_and_the_buffer_stays_releasable(cluster):
    """At TP 1 on CPU the bucket's tensors are views of the policy's flat parameter buffer (bf16 and
    fp32 here, one tensor not contiguous, one empty). Sending them must not pin that buffer: the
    colocated release resizes its storage to 0 right after the sync (rlmega.megatron.offload).
    Tensor.numpy() pinned it for good ("Trying to resize storage that is not resizable")."""
    from rlmega.megatron import offload

    gen = torch.Generator().manual_seed(0)
    flat, flat16 = torch.randn(1000, generator=gen), torch.randn(300, generator=gen).to(torch.bfloat16)
    bucket = [("w", flat[100:400].view(20, 15)), ("wt", flat[:600].view(20, 30).t()), ("n", flat16[10:42]),
              ("empty", flat[0:0].view(0, 4))]
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
