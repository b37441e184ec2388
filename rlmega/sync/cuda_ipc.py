"""CUDA IPC handles of a bucket's tensors: what ``CudaIpcTransport`` sends instead of the bytes.

On one node the trainer's gathered HF tensors are already on a GPU, and the engine's model is on
that GPU (colocated) or a neighbour. ``torch.multiprocessing.reductions.reduce_tensor`` turns a CUDA
tensor into a picklable handle (a cudaIpcMemHandle of its storage, offsets, a ref counter); another
process rebuilds a tensor over the same device memory from it, with no copy through the host. The
engine's worker extension rebuilds them and loads them in the sync's one reload, like the shared-memory
buckets (rlmega/sync/bucket_files.py writes these records to an ``.ipc`` file instead of bytes).

Rules the sender keeps: the tensors stay alive and unchanged until ``flush`` returns (the engine reads
the trainer's memory), and their kernels have finished before the handles go (``ipc_bucket``
synchronises). Device numbers differ between processes (each Ray worker sees its own
CUDA_VISIBLE_DEVICES), so a handle names its GPU by UUID and the reader maps it to its own index.

Run on one GPU (an H200, vLLM 0.26, 2026-11-27; tests/gpu/test_vllm_on_gpu.py): the records of a
0.92 GiB bf16 model went through a RolloutWorker to the engine's own process, which opened them and
reloaded a sync in 0.20-0.21 s (0.40 s into a CUDA-graph engine); the first sync of the run, through
host shared memory, took 1.33 s (slots made included). The engine's log-probs then matched the
trainer's (mean 0.009 in bf16).

TODO(gpu), not run yet: processes with different CUDA_VISIBLE_DEVICES (Ray's engines on other GPUs
of the node see only their own: the UUID lookup below then refuses), and an engine at TP > 1 (each
worker maps the whole tensor).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class IpcTensor:
    """One tensor as a CUDA IPC handle, with what the reader checks it against."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device_uuid: str
    rebuild: object  # reduce_tensor's function ...
    args: tuple  # ... and its arguments (args[6] is the storage's device index in the sender)

    def open(self) -> torch.Tensor:
        """The tensor, over the sender's device memory, on this process's index of that GPU."""
        args = list(self.args)
        if torch.cuda.is_available():
            args[_DEVICE_ARG] = local_device(self.device_uuid)
        t = self.rebuild(*args)
        if str(t.dtype).removeprefix("torch.") != self.dtype or tuple(t.shape) != tuple(self.shape):
            raise ValueError(
                f"CUDA IPC handle rebuilt as {t.dtype} {tuple(t.shape)}, "
                f"sent as {self.dtype} {tuple(self.shape)}"
            )
        return t


# rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, DEVICE, handle, ...)
_DEVICE_ARG = 6


def ipc_bucket(
    bucket: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, IpcTensor]], list[torch.Tensor]]:
    """IPC records of a bucket of CUDA tensors, and the tensors they point at (keep them until the
    engines have loaded them); a clear error for anything else."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "CudaIpcTransport needs CUDA: this process has no GPU (use RayTransport)"
        )
    off = [name for name, t in bucket if not t.is_cuda]
    if off:
        raise ValueError(
            f"CudaIpcTransport sends CUDA tensors only; on {bucket[0][1].device}: {off[:4]} "
            "(use RayTransport for host tensors)"
        )
    from torch.multiprocessing.reductions import reduce_tensor

    # the gathers that made these tensors have finished before anyone reads them
    torch.cuda.synchronize()
    out, kept = [], []
    for name, t in bucket:
        t = t.detach().contiguous()
        rebuild, args = reduce_tensor(t)
        out.append(
            (
                name,
                IpcTensor(
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    t.nbytes,
                    str(torch.cuda.get_device_properties(t.device).uuid),
                    rebuild,
                    tuple(args),
                ),
            )
        )
        kept.append(t)
    return out, kept


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(
        f"GPU {uuid} (a CUDA IPC handle's) is not visible to this process "
        "(CUDA_VISIBLE_DEVICES): the engine must share the trainer's node and see its GPU"
    )
