"""Move tensors' storages to host memory and back, byte for byte (both training backends).

Offloading copies each distinct *storage* behind the given tensors to a host byte tensor and
resizes the storage to zero bytes: the device memory is released while every view of it (the
module's parameters, the optimizer's references, FSDP2's sharded DTensors' local tensors) stays
valid. Onloading resizes it back and copies the bytes in, so the tensors are bit-identical and
training continues as if nothing happened.

On a GPU the host copies are pinned; on the CPU the same path runs (a fresh host copy, then the
original storage is freed), which is how the tests prove the storage really is released.
What to offload (which tensors a backend holds) is each backend's business:
rlmega/megatron/offload.py collects Megatron's buffers, rlmega/fsdp/model_manager.py FSDP2's shards.
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
    # checked before anything moves: a failure half-way would free some storages and lose their copies
    if fixed:
        raise RuntimeError(
            f"{len(fixed)} of {len(storages)} storages ({sum(s.nbytes() for s in fixed)} bytes) are not resizable, "
            "so they cannot be released; torch marks a storage so when Tensor.numpy() or torch.from_numpy() "
            "shares its memory with numpy"
        )
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
