"""A CPU tensor's bytes as a numpy array, without a copy and without freezing the tensor's storage.

Used where a bucket's bytes leave the process: the object store (rlmega/sync/transports.py) and the
shared-memory bucket files (rlmega/sync/bucket_files.py).
"""

from __future__ import annotations

import numpy as np
import torch


class _ByteView:
    """A contiguous CPU tensor's bytes as numpy sees them (``__array_interface__``), holding the tensor.

    ``Tensor.numpy()`` would be the same zero-copy view, but torch marks the tensor's storage
    non-resizable for good when it makes one (torch/csrc/utils/tensor_numpy.cpp, ``tensor_to_numpy``:
    ``set_resizable(false)``, kept after the array is gone). On CPU at TP 1 the bucket's tensors
    are views of the policy's own parameter storage (Megatron's flat DDP buffer), so after one
    weight sync the colocated release (rlmega.megatron.offload, ``storage.resize_(0)``) failed with
    "Trying to resize storage that is not resizable". This view leaves the storage as it was; it
    lives only while ``ray.put`` copies the bytes into the object store, and the trainer releases
    parameters only after the sync has flushed.
    """

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # numpy keeps this object (the array's .base), so the memory stays alive
        self.__array_interface__ = {
            "data": (t.data_ptr(), True),
            "shape": (t.numel() * t.element_size(),),
            "typestr": "|u1",
            "version": 3,
        }


def byte_array(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` (on the CPU, contiguous) as a read-only uint8 array, without a copy."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_ByteView(t))
