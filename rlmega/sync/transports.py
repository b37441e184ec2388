"""How a bucket of HF-named tensors reaches the rollout engines.

``sync_model_to_rollout`` (MegatronActor) streams each pipeline stage's weights as buckets
from one sender rank per stage and hands each bucket to a transport:

    DirectTransport([worker, ...])   engines are objects in this process (tests, one-process runs)
    RayTransport([handle, ...])      engines are Ray actors: the bucket goes into the object store
                                     once, as raw bytes, and every engine reads it from there
                                     (zero-copy on a node)

A transport is picklable (it travels to the trainer ranks) and has one method,
``send(bucket, version)``, that returns once every engine has taken the bucket. On GPUs the next
transport is vLLM's own weight-transfer engine over NCCL/CUDA IPC; the interface stays the same.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

Bucket = list[tuple[str, torch.Tensor]]


def _tensors_from_bytes(names, arrays, dtypes, shapes) -> Bucket:
    """Where a bucket is read (the engine): tensors over the object store's memory, no copy."""
    with warnings.catch_warnings():
        # "The given NumPy array is not writable": the engine's weight loaders only read them.
        warnings.simplefilter("ignore", UserWarning)
        return [(n, torch.from_numpy(a).view(dt).reshape(sh)) for n, a, dt, sh in zip(names, arrays, dtypes, shapes)]


class _RawBucket:
    """A bucket that pickles as each tensor's own bytes (numpy byte views: pickle-5 out-of-band).

    A torch.Tensor pickles its whole storage: a view into Megatron's flat DDP parameter buffer
    (every replicated norm weight) would carry the whole buffer, once per tensor (10.4 GB for a
    0.4 GB model at TP1), and torch's storage pickling copies several times on both sides.
    Here ray.put makes one copy into the object store and the reader none.
    """

    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    def __reduce__(self):
        ts = [t.detach().cpu().contiguous() for _, t in self.bucket]
        return _tensors_from_bytes, ([n for n, _ in self.bucket], [t.reshape(-1).view(torch.uint8).numpy() for t in ts],
                                     [t.dtype for t in ts], [tuple(t.shape) for t in ts])


class DirectTransport:
    def __init__(self, engines: Sequence):
        self.engines = list(engines)

    def send(self, bucket: Bucket, version: int) -> None:
        for engine in self.engines:
            engine.update_weights(bucket, version)


class RayTransport:
    def __init__(self, engines: Sequence, timeout_s: float = 600.0):
        self.engines, self.timeout_s = list(engines), timeout_s

    def send(self, bucket: Bucket, version: int) -> None:
        import ray

        ref = ray.put(_RawBucket(bucket))  # once, shared by all engines
        ray.get([e.update_weights.remote(ref, version) for e in self.engines], timeout=self.timeout_s)
