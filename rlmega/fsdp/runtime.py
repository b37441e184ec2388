"""Process group for the FSDP backend, from torchrun's environment."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed's default group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    unless it already is (nccl on a GPU, gloo on the CPU), and bind this process to the GPU
    LOCAL_RANK names. Returns (rank, world_size)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"init_distributed: {', '.join(missing)} not set; start the ranks with torchrun "
                               "(or set them as torchrun does)")
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
