"""Process groups, model parallelism and seeds for one Megatron rank.

Each trainer rank calls ``init_megatron(tp, pp, vpp, seed)`` once, after its launcher (torchrun,
a Ray actor, ``rlmega.testing.multiproc``) has set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` (and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` on GPUs). Without a GPU it uses gloo and
switches on the CPU layer (``cpu_support``; both, and the MoE- and MLA-without-Transformer-Engine shims
``cpu_support.moe_without_transformer_engine`` / ``mla_without_transformer_engine``, patch megatron-core for the
whole process); with GPUs
it uses NCCL and binds the rank to the GPU ``device_ordinal`` picks (torchrun: all of the node's GPUs
visible; Ray: one GPU per actor).
``teardown_megatron()`` undoes it, so one process can set up several layouts in a row.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from rlmega.process.distributed import collective_device, init_distributed
from rlmega.megatron.cpu_support import (
    enable_cpu_execution,
    mla_without_transformer_engine,
    moe_without_transformer_engine,
)


def device() -> torch.device:
    """Where this rank's tensors live."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This rank's data-parallel (rank, size): which share of a global batch it takes."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def tensor_parallel_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def context_parallel_rank() -> int:
    return parallel_state.get_context_parallel_rank()


def replica_rank() -> int:
    """This rank's place among the ranks holding the same model shard (DP x CP): 0 sends and writes it."""
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def barrier() -> None:
    dist.barrier()


def for_collective(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` (contiguous) on the device collectives over ``group`` take; callers move results back."""
    return tensor.to(collective_device(dist.get_backend(group))).contiguous()


def set_seeds(seed: int) -> None:
    """Seed Python, NumPy and torch, and Megatron's model-parallel RNG states.

    Megatron derives the tensor-parallel state as seed + 2718 + tp_rank, so dropout inside
    TP regions differs between TP ranks and matches across data-parallel replicas.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_megatron(
    tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, ep: int = 1, cp: int = 1
) -> None:
    """Process group + Megatron model-parallel groups + seeds for this rank.

    ``cp`` is parallelism.context_parallel_size: each micro-batch's row split over CP ranks
    (rlmega/megatron/context_parallel.py); the data-parallel size is world / (TP x PP x CP).

    ``ep`` is parallelism.expert_model_parallel_size (expert tensor parallel = TP, megatron's default):
    the experts of an MoE layer are split over EP ranks taken from the data-parallel ranks."""
    enable_cpu_execution()  # no-op with a GPU
    # process-global: MoE routers without Transformer Engine (GPU or CPU)
    moe_without_transformer_engine()
    # process-global: multi-latent attention without Transformer Engine
    mla_without_transformer_engine()
    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP x PP x CP = {tp} x {pp} x {cp}; "
            "change parallelism.world_size or the TP/PP/CP sizes"
        )
    if ep < 1 or world % (tp * ep * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP x EP x PP = {tp} x {ep} x {pp}; "
            "change parallelism.expert_model_parallel_size or the world size"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
    )
    set_seeds(seed)


def teardown_megatron(destroy_process_group: bool = True) -> None:
    """Release Megatron's groups (and, by default, the default process group)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
