"""How a bucket of HF-named tensors reaches the rollout engines.

``sync_model_to_rollout`` (MegatronActor) streams each pipeline stage's weights as buckets
from one sender rank per stage and hands each bucket to a transport:

    DirectTransport([worker, ...])   engines are objects in this process (tests, one-process runs)
    RayTransport([handle, ...])      engines are Ray actors: the bucket goes into the object store
                                     once and every engine reads it from there (zero-copy on a node)

A transport is picklable (it travels to the trainer ranks) and has one method,
``send(bucket, version)``, that returns once every engine has taken the bucket. On GPUs the next
transport is vLLM's own weight-transfer engine over NCCL/CUDA IPC; the interface stays the same.
"""
from __future__ import annotations

from typing import Sequence

import torch

Bucket = list[tuple[str, torch.Tensor]]


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

        ref = ray.put([(name, t.cpu()) for name, t in bucket])  # once, shared by all engines
        ray.get([e.update_weights.remote(ref, version) for e in self.engines], timeout=self.timeout_s)
