"""Which checkpoint folders can be resumed from, judged by the driver before any worker loads one.

A Megatron distributed checkpoint (torch_dist backend, rlmega/megatron/checkpoint.py) is complete when

    metadata.json     Megatron's format record, written last
    common.pt         rank 0's plain state (step, LR schedule, the driver's extras), loadable
    .metadata         torch DCP's index: every tensor's (file, offset, length)
    __R_K.distcp      each shard file the index names, at least as long as its last entry

An FSDP checkpoint (plain torch DCP, rlmega/fsdp/checkpoint.py) has no metadata.json: its common.pt
says meta["backend"] == "fsdp", and the same .metadata index and shard files must be whole.

A truncated or missing shard otherwise fails inside every worker on every resume; here it is found
by reading the index and file sizes, and a shard damaged at full length by the sha256 each save writes
(rundir/shard_checksums.py), so the driver can fall back to an older checkpoint or say what is wrong.
Torch only: megatron.core stays in rlmega/megatron/.

Nothing here runs code from the folder (it may come from elsewhere): metadata.json is JSON, common.pt is read
with torch's weights-only loader, and .metadata with an unpickler that builds only DCP's own record classes
(rundir/checkpoint_data.py). A file that names anything else makes the checkpoint incomplete, by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlmega.rundir import shard_checksums  # stdlib only: config loading imports this module

STEP_DIR = re.compile(r"^step_(\d{8})$")


def problem(path: str | Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (one line), or None when it is."""
    path = Path(path)
    if not path.is_dir():
        return "not a folder"
    if path.name.endswith(".partial"):
        return "an unfinished save (.partial)"
    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except FileNotFoundError:
        return _fsdp_problem(path)
    except (OSError, ValueError, AttributeError) as e:
        return f"metadata.json unreadable ({e})"
    # Megatron's other backends (zarr, ...) load by code rlmega never runs or checks
    if backend != "torch_dist":
        named = (
            "no sharded_backend" if backend is None else f"sharded_backend {str(backend)[:40]!r}"
        )
        return f"metadata.json names {named}; rlmega writes and reads 'torch_dist' only"
    try:
        read_common(path)
    except FileNotFoundError:
        return "common.pt missing"
    except Exception as e:  # torch.load raises many kinds on a truncated zip/pickle
        return _load_failure("common.pt", e)
    return _shards_problem(path)


def _fsdp_problem(path: Path) -> str | None:
    """A folder without metadata.json: complete when it is a whole FSDP (plain DCP) checkpoint."""
    try:
        common = read_common(path)
        meta = common.get("meta") if isinstance(common, dict) else None
    except FileNotFoundError:
        return "no metadata.json (Megatron) or common.pt (FSDP): not a checkpoint, or a save that never finished"
    except Exception as e:
        return _load_failure("common.pt", e)
    if not isinstance(meta, dict) or meta.get("backend") != "fsdp":
        return "no metadata.json (not a checkpoint, or a save that never finished)"
    return _shards_problem(path)


def _load_failure(what: str, e: Exception) -> str:
    """Why ``what`` (common.pt, a saved object) did not load, in one line: a refused global by name (torch's own
    message advises loading it with weights_only=False, which is what must not happen to a file from elsewhere)."""
    # torch words it "Unsupported global: GLOBAL x.y ..." or "unsupported GLOBAL x.y whose module ... is blocked"
    refused = re.search(r"(?i)unsupported(?: global:)? GLOBAL (\S+)", str(e))
    if refused:
        return (
            f"{what} refused: it names {refused.group(1)}, more than tensors and plain values (a checkpoint "
            "rlmega wrote holds only those)"
        )
    return f"{what} unreadable ({type(e).__name__}: {str(e)[:120]})"


def read_common(path: str | Path) -> dict:
    """common.pt, loaded as Megatron's load_common_state_dict loads it (torch.load, weights only: what loads
    here loads there)."""
    import torch  # here, not at the top: config loading imports this module and must stay quick

    return torch.load(Path(path) / "common.pt", map_location="cpu", weights_only=True)


def _shards_problem(path: Path) -> str | None:
    from rlmega.rundir.checkpoint_data import CheckpointDataError, read_index

    try:
        index = read_index(path)
    except FileNotFoundError:
        return ".metadata (the shard index) missing"
    except CheckpointDataError as e:
        return f".metadata (the shard index) refused: {e}"
    except Exception as e:  # noqa: BLE001 -- a damaged pickle raises many kinds
        return f".metadata (the shard index) unreadable ({type(e).__name__})"
    if not hasattr(index, "storage_data") or not isinstance(index.storage_data, dict):
        return ".metadata (the shard index) is not a DCP index"
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name in sorted(needed):
        # the index names files of this folder only
        if Path(name).name != name or not name.endswith(".distcp"):
            return f"the index names shard {name[:80]!r}, not a .distcp file of this folder"
        f = path / name
        if not f.is_file():
            return f"shard {name} missing (the index lists {len(needed)} shard files)"
        size = f.stat().st_size
        if size < needed[name]:
            return f"shard {name} truncated ({size} of {needed[name]} bytes)"
    return shard_checksums.problem(path, sorted(needed)) or _objects_problem(path, index)


def _objects_problem(path: Path, index) -> str | None:
    """The index's non-tensor items (RNG states, param groups, extra states: small) loaded as the learners load
    them (checkpoint_data.load_object), so that one naming code is refused here, by name, before any worker."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from rlmega.rundir.checkpoint_data import load_object

    for key, info in index.storage_data.items():
        if not isinstance(index.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            continue
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            load_object(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001 -- refused, or damaged
            return _load_failure(f"saved object {key.fqn[:80]!r} ({info.relative_path})", e)
    return None


def step_folders(root: str | Path) -> list[Path]:
    """checkpoints/step_N folders under ``root``, newest first (.partial saves excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), reverse=True
    )


def latest_name(root: str | Path) -> str | None:
    """What ``root/latest`` names ("" when empty), or None when there is no such file."""
    pointer = Path(root) / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def auto_choice(root: str | Path) -> Path | None:
    """The checkpoint ``trainer.resume=auto`` starts from under ``root``: the one ``latest`` names when it is
    complete (a newer step folder may be an abandoned branch, or a save whose ``latest`` was never written),
    else the newest complete one; None when none is (RunDir.checkpoint_to_resume says what then)."""
    named = latest_name(root)
    if named and (Path(root) / named).is_dir() and problem(Path(root) / named) is None:
        return Path(root) / named
    return newest_complete(root)[0]


def newest_complete(root: str | Path) -> tuple[Path | None, list[str]]:
    """(the newest complete step folder under ``root`` or None, a note per newer folder skipped).

    Newest by step number, not by ``latest``: a ``latest`` that is missing, empty, dangling or names
    a damaged save must not send a resume back to step 0 while complete checkpoints exist.
    """
    skipped = []
    for p in step_folders(root):
        why = problem(p)
        if why is None:
            return p, skipped
        skipped.append(f"{p.name}: {why}")
    return None, skipped
