"""Which GPU a trainer rank binds to, and where collective tensors live (rlmega.megatron.runtime)."""

import pytest
import torch

from rlmega.process.distributed import collective_device, device_ordinal


def test_torchrun_sees_every_gpu_of_the_node_and_binds_local_rank():
    assert [device_ordinal(r, 8, 8) for r in range(8)] == list(range(8))
    assert device_ordinal(0, 1, 1) == 0


def test_ray_gives_each_rank_one_gpu_so_every_rank_binds_ordinal_zero():
    # A Ray actor with num_gpus=1 sees one GPU (CUDA_VISIBLE_DEVICES), whatever its index on the
    # node: binding LOCAL_RANK (the old behaviour) would be an invalid ordinal for ranks >= 1.
    assert [device_ordinal(r, 8, 1) for r in range(8)] == [0] * 8


def test_more_local_ranks_than_visible_gpus_is_a_clear_error():
    with pytest.raises(RuntimeError, match="4 ranks on this node but 2 GPUs visible"):
        device_ordinal(3, 4, 2)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        device_ordinal(0, 1, 0)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 is outside LOCAL_WORLD_SIZE=4"):
        device_ordinal(5, 4, 4)


def test_gloo_collectives_stay_on_the_host():
    assert collective_device("gloo") == torch.device("cpu")

    # The NCCL side (a CUDA device) is checked in tests/gpu/test_megatron_on_gpu.py.
