"""Process groups, model parallelism and seeds for one Megatron rank.

Each trainer rank calls ``init_megatron(tp, pp, vpp, seed)`` once, after its launcher (torchrun,
a Ray actor, ``rlmega.testing.multiproc``) has set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` (and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` on GPUs). Without a GPU it uses gloo and
switches on the CPU layer (``cpu_support``); with GPUs it uses NCCL and binds the rank to the GPU
``device_ordinal`` picks (torchrun: all of the node's GPUs visible; Ray: one GPU per actor).
``teardown_megatron()`` undoes it, so one process can set up several layouts in a row.
"""
from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from rlmega.bound_store import BoundTCPStore
from rlmega.megatron.cpu_support import enable_cpu_execution


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


def barrier() -> None:
    dist.barrier()


def device_ordinal(local_rank: int, local_world_size: int, visible_devices: int) -> int:
    """The CUDA ordinal this rank binds to, among the GPUs this process can see.

    * torchrun (and Slurm): every process sees all of its node's GPUs, so rank ``local_rank`` of
      ``local_world_size`` takes GPU ``local_rank``.
    * Ray: each trainer actor sees only the GPU Ray gave it (``CUDA_VISIBLE_DEVICES`` holds one id),
      so whatever its index among the node's ranks, its GPU is ordinal 0.
    Anything else (more local ranks than visible GPUs, several but not all visible) is a launch
    mistake, reported here rather than as an invalid-ordinal or duplicate-GPU error inside NCCL.
    """
    if visible_devices < 1:
        raise RuntimeError("no CUDA device is visible to this rank: check CUDA_VISIBLE_DEVICES "
                           "(Ray: give trainer actors num_gpus > 0)")
    if not 0 <= local_rank < max(local_world_size, 1):
        raise RuntimeError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")
    if local_world_size <= visible_devices:
        return local_rank
    if visible_devices == 1:
        return 0
    raise RuntimeError(
        f"{local_world_size} ranks on this node but {visible_devices} GPUs visible to LOCAL_RANK={local_rank}: "
        "run at most one rank per GPU (torchrun --nproc-per-node <= GPUs) or give each rank exactly one "
        "GPU through CUDA_VISIBLE_DEVICES")


def collective_device(backend: str) -> torch.device:
    """Where a tensor must live for a collective on a group with ``backend``.

    NCCL moves device memory only (a CPU tensor fails with "No backend type associated with device
    type cpu"); gloo works on host tensors. Megatron's groups are NCCL on GPUs, gloo here.
    """
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def for_collective(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` (contiguous) on the device collectives over ``group`` take; callers move results back."""
    return tensor.to(collective_device(dist.get_backend(group))).contiguous()


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the default process group from the launcher's environment (idempotent)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed needs {', '.join(missing)} in the environment: launch with "
            "torchrun, through rlmega's Ray launcher, or rlmega.testing.multiproc.run_on_ranks"
        )
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        torch.cuda.set_device(device_ordinal(local_rank, local_world, torch.cuda.device_count()))
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store (rlmega.launch.torchrun makes it listen on MASTER_ADDR only)
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # Rank 0 hosts the store, as env:// would, but listening on MASTER_ADDR only (the launcher gives
    # 127.0.0.1 to a one-node group): torch's own server listens on every interface, with no auth.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = BoundTCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def set_seeds(seed: int) -> None:
    """Seed Python, NumPy and torch, and Megatron's model-parallel RNG states.

    Megatron derives the tensor-parallel state as seed + 2718 + tp_rank, so dropout inside
    TP regions differs between TP ranks and matches across data-parallel replicas.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_megatron(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Process group + Megatron model-parallel groups + seeds for this rank."""
    enable_cpu_execution()  # no-op with a GPU
    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP x PP = {tp} x {pp}; "
            "change parallelism.world_size or the TP/PP sizes"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    set_seeds(seed)


def teardown_megatron(destroy_process_group: bool = True) -> None:
    """Release Megatron's groups (and, by default, the default process group)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
