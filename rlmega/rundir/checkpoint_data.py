"""Checkpoints read as data, never as code: a checkpoint may come from elsewhere (issue 57).

    index = read_index(step_folder)         # torch DCP's .metadata, only DCP's own record classes allowed
    obj = load_object(buffer)               # one saved object: torch's weights-only loader (+ NumPy arrays)
    with data_only_loads():                 # around dcp.load / dist_checkpointing.load, on every rank
        dcp.load(state, checkpoint_id=...)

Why: both learners' checkpoints are torch DCP folders, and DCP reads two things with plain pickle, which runs
whatever a crafted file names: the ``.metadata`` index (FileSystemReader.read_metadata: ``pickle.load``) and
every non-tensor item (DefaultLoadPlanner.load_bytes: ``torch.load(weights_only=False)``; Megatron's
MCoreLoadPlanner inherits it): the RNG states, optimizer param groups, Megatron's ``_extra_state``. A
``.metadata`` that wrote a file when the driver only scanned the folder was the audit's first finding.

Here the index goes through an unpickler that builds only the classes DCP writes into it (the list below,
read off real Megatron and FSDP checkpoints); anything else is refused by name (``CheckpointDataError``). Saved
objects go through torch's weights-only unpickler (tensors, containers, numbers, strings), with NumPy's array
reconstruction allowed: the Megatron RNG state holds NumPy's generator state. ``common.pt`` is read with
``torch.load(weights_only=True)`` everywhere (rundir/checkpoint_scan.py, Megatron's load_common_state_dict).
Tensors themselves are raw bytes to DCP: no pickle.

``data_only_loads`` swaps the two DCP methods for these while a load runs (a context, not an import-time patch:
nothing else in the process sees it), in the worker process that loads.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path

import numpy as np
import torch


class CheckpointDataError(ValueError):
    """A checkpoint file that holds more than data (a class or function outside the allowlist)."""


# What torch DCP pickles into .metadata (torch 2.13): its record dataclasses and enums, torch.Size, dtypes and
# layouts by name, and the checkpoint's id as a path. Every one only stores fields; none runs code of the file's.
_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}

# NumPy arrays in saved objects (Megatron's RNG state holds np.random.get_state()): rebuilding an array only
# allocates it; the class it is rebuilt as must itself be allowed (ndarray).
_NUMPY_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    np.dtypes.Float64DType,
    np.dtypes.Int64DType,
    np._core.multiarray._reconstruct,
    np._core.multiarray.scalar,
]


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        # torch.float32 ...
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointDataError(
            f"it names {module}.{name}, which is not one of the record classes torch DCP "
            "writes there: refused, never imported"
        )


def read_index_file(f) -> object:
    """A DCP ``.metadata`` index from the open binary file ``f``, as data (CheckpointDataError otherwise)."""
    return _IndexUnpickler(f).load()


def read_index(path: str | Path) -> object:
    """The DCP index (torch.distributed.checkpoint.metadata.Metadata) of the checkpoint folder ``path``."""
    with open(Path(path) / ".metadata", "rb") as f:
        return read_index_file(f)


def load_object(buffer) -> object:
    """One object DCP saved (a torch.save stream), with torch's weights-only unpickler."""
    with torch.serialization.safe_globals(_NUMPY_GLOBALS):
        return torch.load(buffer, map_location="cpu", weights_only=True)


def _read_metadata(self, *args, **kwargs):
    """FileSystemReader.read_metadata, with the index read as data."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
        metadata = read_index_file(f)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, with the object read by ``load_object``."""
    # DCP's own helper, as load_bytes uses it
    from torch.distributed.checkpoint._traverse import set_element

    obj = load_object(value)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def data_only_loads():
    """While it is open, torch DCP reads checkpoints (.metadata and saved objects) as data (module docstring)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = _read_metadata, _load_bytes
    try:
        yield
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved
