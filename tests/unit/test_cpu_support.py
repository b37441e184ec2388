"""The CPU layer answers megatron-core's CUDA questions, changes no numbers, and can be undone."""

import pytest
import torch

from megatron.core.tensor_parallel import random as mcore_random

from rlmega.megatron import cpu_support

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU layer is inert with a GPU"
)


@pytest.fixture
def cpu_layer():
    assert cpu_support.enable_cpu_execution()
    yield
    cpu_support.disable_cpu_execution()


def _workload() -> torch.Tensor:
    """A bit of everything a forward pass does, with its own seeded generator."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 32, generator=g)
    w = torch.randn(32, 16, generator=g)
    h = torch.nn.functional.silu(x @ w)
    return torch.log_softmax(h, dim=-1).cumsum(0)


def test_cuda_device_requests_land_on_cpu(cpu_layer):
    for dev in ("cuda", "cuda:1", 0, torch.device("cuda", 0), torch.cuda.current_device()):
        assert torch.zeros(2, device=dev).device.type == "cpu", dev
    t = torch.ones(3)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(torch.device("cuda"), torch.float64).dtype == torch.float64
    assert torch.device("cuda").type == "cpu"
    torch.cuda.synchronize()  # a no-op, not an error


def test_type_queries_answer_as_cuda(cpu_layer):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    assert torch.ones(1, dtype=torch.int64).type() == "torch.LongTensor"  # not a param type
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_numerics_are_bit_identical_with_the_layer():
    plain = _workload()
    cpu_support.enable_cpu_execution()
    try:
        layered = _workload()
    finally:
        cpu_support.disable_cpu_execution()
    assert torch.equal(plain, layered)


def _dropout_mask(tp_rank: int) -> torch.Tensor:
    mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    with mcore_random.get_cuda_rng_tracker().fork():
        return torch.nn.functional.dropout(torch.ones(64), p=0.5)


def test_rng_tracker_differs_across_tp_ranks_and_is_reproducible(cpu_layer):
    assert isinstance(mcore_random.get_cuda_rng_tracker(), cpu_support.CpuRNGStatesTracker)
    a0, a1, again = _dropout_mask(0), _dropout_mask(1), _dropout_mask(0)
    assert not torch.equal(a0, a1)  # TP ranks draw different dropout masks
    assert torch.equal(a0, again)  # the same seed and rank reproduce them


def test_fork_advances_its_state_and_restores_the_outer_one(cpu_layer):
    mcore_random.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = mcore_random.get_cuda_rng_tracker()
    torch.manual_seed(0)
    expected_outer = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the named state moved on
    assert torch.equal(torch.rand(4), expected_outer)  # the caller's stream is untouched


def test_disable_restores_torch_and_megatron(cpu_layer):
    cpu_support.disable_cpu_execution()
    try:
        with pytest.raises((AssertionError, RuntimeError), match="(?i)cuda"):
            torch.zeros(1, device="cuda")
        with pytest.raises((AssertionError, RuntimeError), match="(?i)cuda"):
            torch.cuda.current_device()
        assert torch.ones(1).type() == "torch.FloatTensor"
        assert not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, cpu_support.CpuRNGStatesTracker)
    finally:
        cpu_support.enable_cpu_execution()  # the fixture disables it again


def test_inert_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert cpu_support.enable_cpu_execution() is False
    assert not cpu_support.cpu_execution_enabled()
    assert torch.cuda.current_device is current_device
    assert torch.ones(1).type() == "torch.FloatTensor"
