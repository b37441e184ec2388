"""Which checkpoint folders can be resumed from, judged by the driver before any worker loads one.

A Megatron distributed checkpoint (torch_dist backend, rlmega/megatron/checkpoint.py) is complete when

    metadata.json     Megatron's format record, written last
    common.pt         rank 0's plain state (step, LR schedule, the driver's extras), loadable
    .metadata         torch DCP's index: every tensor's (file, offset, length)
    __R_K.distcp      each shard file the index names, at least as long as its last entry

An FSDP checkpoint (plain torch DCP, rlmega/fsdp/checkpoint.py) has no metadata.json: its common.pt
says meta["backend"] == "fsdp", and the same .metadata index and shard files must be whole.

A truncated or missing shard otherwise fails inside every worker on every resume; here it is found
by reading the index and file sizes (no tensor is read), so the driver can fall back to an older
checkpoint or say what is wrong. Torch only: megatron.core stays in rlmega/megatron/.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

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
    try:
        read_common(path)
    except FileNotFoundError:
        return "common.pt missing"
    except Exception as e:  # torch.load raises many kinds on a truncated zip/pickle
        return f"common.pt unreadable ({type(e).__name__}: {str(e)[:120]})"
    if backend == "torch_dist":
        return _shards_problem(path)
    return None


def _fsdp_problem(path: Path) -> str | None:
    """A folder without metadata.json: complete when it is a whole FSDP (plain DCP) checkpoint."""
    try:
        meta = read_common(path).get("meta", {})
    except FileNotFoundError:
        return "no metadata.json (Megatron) or common.pt (FSDP): not a checkpoint, or a save that never finished"
    except Exception as e:
        return f"common.pt unreadable ({type(e).__name__}: {str(e)[:120]})"
    if meta.get("backend") != "fsdp":
        return "no metadata.json (not a checkpoint, or a save that never finished)"
    return _shards_problem(path)


def read_common(path: str | Path) -> dict:
    """common.pt, loaded as Megatron's load_common_state_dict loads it (so what loads here loads there)."""
    import torch  # here, not at the top: config loading imports this module and must stay quick

    return torch.load(Path(path) / "common.pt", map_location="cpu")


def _shards_problem(path: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return ".metadata (the shard index) missing"
    except Exception as e:
        return f".metadata (the shard index) unreadable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(needed):
        f = path / name
        if not f.is_file():
            return f"shard {name} missing (the index lists {len(needed)} shard files)"
        size = f.stat().st_size
        if size < needed[name]:
            return f"shard {name} truncated ({size} of {needed[name]} bytes)"
    return None


def step_folders(root: str | Path) -> list[Path]:
    """checkpoints/step_N folders under ``root``, newest first (.partial saves excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), reverse=True)


def latest_name(root: str | Path) -> str | None:
    """What ``root/latest`` names ("" when empty), or None when there is no such file."""
    pointer = Path(root) / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


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
