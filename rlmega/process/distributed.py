"""The default process group of a trainer rank, for either backend.

``init_distributed`` joins it from the launcher's environment (torchrun, a Ray WorkerGroup,
``rlmega.testing.multiproc``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` on GPUs. gloo without a GPU; NCCL with GPUs, the rank bound to
the GPU ``device_ordinal`` picks (torchrun: all of the node's GPUs visible; Ray: one GPU per actor).
Rank 0's store listens on MASTER_ADDR only (rlmega.process.bound_store), never on every interface.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from rlmega.process.bound_store import BoundTCPStore


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
        raise RuntimeError(
            "no CUDA device is visible to this rank: check CUDA_VISIBLE_DEVICES "
            "(Ray: give trainer actors num_gpus > 0)"
        )
    if not 0 <= local_rank < max(local_world_size, 1):
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}"
        )
    if local_world_size <= visible_devices:
        return local_rank
    if visible_devices == 1:
        return 0
    raise RuntimeError(
        f"{local_world_size} ranks on this node but {visible_devices} GPUs visible to LOCAL_RANK={local_rank}: "
        "run at most one rank per GPU (torchrun --nproc-per-node <= GPUs) or give each rank exactly one "
        "GPU through CUDA_VISIBLE_DEVICES"
    )


def collective_device(backend: str) -> torch.device:
    """Where a tensor must live for a collective on a group with ``backend``.

    NCCL moves device memory only (a CPU tensor fails with "No backend type associated with device
    type cpu"); gloo works on host tensors. Megatron's groups are NCCL on GPUs, gloo here.
    """
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the default process group from the launcher's environment (idempotent)."""
    if dist.is_initialized():
        return
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
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
    store = BoundTCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
    )
