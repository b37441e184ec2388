"""Move parameters, gradients and optimizer state to host memory and back, byte for byte.

Megatron DDP keeps parameters and gradients in a few large contiguous buffers that every
parameter (and ``param.main_grad``) is a view of. Offloading copies each distinct *storage* to a
host byte tensor and resizes the storage to zero bytes: the device memory is released while every
view, including the optimizer's references, stays valid. Onloading resizes it back and copies the
bytes in, so the tensors are bit-identical and training continues as if nothing happened.

On a GPU the host copies are pinned; on the CPU the same path runs (a fresh host copy, then the
original storage is freed), which is how the tests prove the storage really is released.
"""
from __future__ import annotations

from typing import Iterable

import torch

Saved = list[tuple[torch.UntypedStorage, torch.Tensor]]


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(s)
    return out


def offload_tensors(tensors: Iterable[torch.Tensor]) -> Saved:
    """Copy the storages behind ``tensors`` to host memory and free them."""
    saved: Saved = []
    pin = torch.cuda.is_available()
    storages = _distinct_storages(tensors)
    fixed = [s for s in storages if not s.resizable()]
    if fixed:  # checked before anything moves: a failure half-way would free some storages and lose their copies
        raise RuntimeError(
            f"{len(fixed)} of {len(storages)} storages ({sum(s.nbytes() for s in fixed)} bytes) are not resizable, "
            "so they cannot be released; torch marks a storage so when Tensor.numpy() or torch.from_numpy() "
            "shares its memory with numpy")
    for storage in storages:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        host.copy_(_bytes_view(storage), non_blocking=pin)
        saved.append((storage, host))
    if pin:
        torch.cuda.synchronize()  # the copies must land before the device memory goes
    for storage, _ in saved:
        storage.resize_(0)
    return saved


def onload_tensors(saved: Saved) -> None:
    """Re-allocate each storage and copy its bytes back."""
    for storage, host in saved:
        storage.resize_(host.numel())
        _bytes_view(storage).copy_(host, non_blocking=False)


def model_params(model: list) -> list[torch.Tensor]:
    return [p.data for chunk in model for p in chunk.parameters()]


def model_grads(model: list) -> list[torch.Tensor]:
    """Megatron DDP's gradient buffers (``param.main_grad`` views)."""
    return [p.main_grad for chunk in model for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The plain torch optimizers inside Megatron's (possibly chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def optimizer_state(optimizer) -> list[torch.Tensor]:
    """Adam moments (and step counters) of every parameter shard this rank owns."""
    return [v for opt in torch_optimizers(optimizer) for st in opt.state.values() for v in st.values()
            if torch.is_tensor(v)]


# Where Megatron's mixed-precision optimizers keep the fp32 master copies: the distributed optimizer
# this rank's shards, the plain one (use_distributed_optimizer=false) a full copy of each parameter.
_MAIN_PARAM_GROUPS = ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")


def main_params(optimizer) -> list[torch.Tensor]:
    """fp32 master copies kept for bf16 training, with or without the distributed optimizer. fp32
    models have none: their master weights are the parameters themselves (offload those with the params)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for o in inner for attr in _MAIN_PARAM_GROUPS for group in getattr(o, attr, []) for p in group]
