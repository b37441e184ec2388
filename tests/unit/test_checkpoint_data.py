"""Checkpoints are data, not code (issue 57): a checkpoint folder from elsewhere whose files name a function runs
nothing, in the driver's scan (rlmega/rundir/checkpoint_scan.py) or in a learner's load
(rlmega/rundir/checkpoint_data.py's data_only_loads, around torch DCP), and is refused by name.

Each payload below makes a folder when unpickled (os.mkdir of ``marker``); each test first shows that plain
pickle / plain DCP does run it, so the test fails if the guard is taken away.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from rlmega.rundir.checkpoint_data import CheckpointDataError, data_only_loads, read_index
from rlmega.rundir.checkpoint_scan import problem


class MakesADir:
    """Unpickled, it calls os.mkdir(path): what a crafted checkpoint would do, harmlessly."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _fsdp_folder(path, state=None):
    """A complete FSDP-format step folder, as rlmega/fsdp/checkpoint.py writes one: DCP files and common.pt."""
    dcp.save(
        state or {"model": {"w": torch.arange(6.0)}, "rng_rank0": b"x"}, checkpoint_id=str(path)
    )
    torch.save({"meta": {"backend": "fsdp", "step": 1, "extra": {}}}, path / "common.pt")
    return path


def test_a_clean_dcp_folder_is_complete(tmp_path):
    folder = _fsdp_folder(tmp_path / "step_00000001")
    assert problem(folder) is None
    assert set(read_index(folder).state_dict_metadata) == {"model.w", "rng_rank0"}


def test_an_index_that_names_a_function_is_refused_and_never_run(tmp_path):
    folder = _fsdp_folder(tmp_path / "step_00000001")
    marker = tmp_path / "ran"
    payload = pickle.dumps(MakesADir(marker))
    # the payload is live: plain pickle (torch's FileSystemReader.read_metadata) runs it
    pickle.loads(payload)
    assert marker.is_dir()
    marker.rmdir()
    (folder / ".metadata").write_bytes(payload)
    why = problem(folder)
    assert why is not None and "refused" in why and "mkdir" in why, why
    assert not marker.exists()
    with pytest.raises(CheckpointDataError, match="mkdir"):
        read_index(folder)


def test_a_common_pt_that_names_a_function_is_refused_and_never_run(tmp_path):
    folder = _fsdp_folder(tmp_path / "step_00000001")
    marker = tmp_path / "ran"
    torch.save({"meta": {"backend": "fsdp"}, "x": MakesADir(marker)}, folder / "common.pt")
    why = problem(folder)
    assert why is not None and why.startswith("common.pt refused: it names") and "mkdir" in why, why
    assert "weights_only=False" not in why  # torch's advice to load it anyway is not passed on
    assert not marker.exists()
    # the file is live: a full unpickle runs it
    torch.load(folder / "common.pt", weights_only=False)
    assert marker.is_dir()


def test_a_saved_object_that_names_a_function_is_not_run_by_a_learners_load(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2), "rng_rank0": MakesADir(marker)}, checkpoint_id=str(folder))
    torch.save({"meta": {"backend": "fsdp", "step": 1, "extra": {}}}, folder / "common.pt")
    # the driver's scan reads saved objects as the learners do, and names the refusal
    why = problem(folder)
    assert why is not None and why.startswith(
        "saved object 'rng_rank0' (__0_0.distcp) refused: it names"
    ), why
    assert "mkdir" in why and not marker.exists()
    # a learner's load, were it reached
    with data_only_loads(), pytest.raises(CheckpointException) as refused:
        dcp.load({"w": torch.empty(2), "rng_rank0": b""}, checkpoint_id=str(folder))
    assert "posix.mkdir" in str(getattr(refused.value, "failures", refused.value))
    assert not marker.exists()
    # DCP's own load runs it
    dcp.load({"w": torch.empty(2), "rng_rank0": b""}, checkpoint_id=str(folder))
    assert marker.is_dir()


def test_data_only_loads_still_load_what_rlmega_saves_and_put_dcp_back(tmp_path):
    """Tensors, numbers, strings, containers and NumPy's generator state (the Megatron RNG) load as saved."""
    import numpy as np

    rng = {
        "python": __import__("random").getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    dcp.save(
        {"w": torch.arange(4.0), "rng": rng, "groups": [{"lr": 1e-4, "name": "a"}]},
        checkpoint_id=str(tmp_path),
    )
    state = {
        "w": torch.empty(4),
        "rng": {"python": None, "numpy": None, "torch": torch.empty_like(rng["torch"])},
        "groups": [{"lr": 0.0, "name": ""}],
    }
    from torch.distributed.checkpoint import FileSystemReader

    before = FileSystemReader.read_metadata
    with data_only_loads():
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert FileSystemReader.read_metadata is before
    assert torch.equal(state["w"], torch.arange(4.0)) and state["groups"] == [
        {"lr": 1e-4, "name": "a"}
    ]
    assert state["rng"]["python"] == rng["python"] and torch.equal(
        state["rng"]["torch"], rng["torch"]
    )
    assert all(np.array_equal(a, b) for a, b in zip(state["rng"]["numpy"], rng["numpy"]))


def test_a_foreign_sharded_backend_and_an_index_reaching_outside_the_folder_are_refused(tmp_path):
    folder = _fsdp_folder(tmp_path / "step_00000001")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert "sharded_backend 'zarr'" in problem(folder)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert problem(folder) is None  # a Megatron-format record over the same DCP files: complete
    index = read_index(folder)
    for info in index.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    assert "not a .distcp file of this folder" in problem(folder)
