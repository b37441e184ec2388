"""A checkpoint root's files, the same for both training backends (no backend import here).

    ROOT/step_00000010/          a complete checkpoint (the backend's format inside)
    ROOT/step_00000012.partial/  a save in progress, or one that crashed: never loaded
    ROOT/step_00000010.replaced/ an older save of the same step, kept until the new one is in
    ROOT/latest                  the newest complete step, written by rename after the save finished

Every rank writes its shards into ``.partial``; after a barrier rank 0 fsyncs it, renames it
(``finish_save``) and then updates ``latest`` (fsynced), so a crash at any point leaves a complete
checkpoint to load. A save that fails undoes itself (``undo_failed_save``) and, when the disk filled
up, says so as CheckpointSpaceError. rlmega/rundir/checkpoint_scan.py judges which folders are complete.
"""

from __future__ import annotations

import errno
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rlmega.rundir import shard_checksums
from rlmega.rundir.durable import fsync_dir, fsync_tree, replace_durably


class CheckpointSpaceError(OSError):
    """The filesystem filled up during a checkpoint save (the save was undone)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (the one ``root/latest`` names), or None."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if path.is_dir() else None


def resolve(path: str | Path) -> Path:
    """A step folder to load: ``path`` itself, or the one its ``latest`` names when it is a root.
    FileNotFoundError when that is not a finished save."""
    path = Path(path)
    if (path / "latest").exists():
        found = latest(path)
        if found is None:
            raise FileNotFoundError(f"{path}/latest points to a missing checkpoint")
        path = found
    if not path.is_dir() or path.suffix == ".partial":
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    return path


def start_save(root: Path, step: int) -> tuple[Path, Path]:
    """(final, partial) folders of a save of ``step``; rank 0 makes a fresh ``.partial``. Collective."""
    final = step_dir(root, step)
    partial = final.with_suffix(".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # the leftovers of a crashed save
        partial.mkdir(parents=True)
    dist.barrier()
    return final, partial


def write_checksums(partial: Path) -> None:
    """``partial``/checksums.json: every shard file's sha256 (rundir/shard_checksums.py), each rank hashing every
    world-th file of the folder (a shared one, as the rename needs), rank 0 writing them all. Collective."""
    names = sorted(p.name for p in partial.glob("*.distcp"))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = shard_checksums.digest(partial, names[rank::world])
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    if rank == 0:
        shard_checksums.write(partial, {name: hex for part in parts for name, hex in part.items()})


def finish_save(root: Path, partial: Path, final: Path) -> None:
    """After every rank's files are in ``partial``: their checksums are written, rank 0 moves it into place and
    points ``latest`` at it; then the older same-step save, if any, goes. Collective."""
    dist.barrier()  # every rank's shards are whole before any is hashed
    write_checksums(partial)
    if dist.get_rank() == 0:
        _move_into_place(partial, final)
        replace_durably(Path(root) / "latest", final.name)
        # only now: there is always a complete step_N
        shutil.rmtree(_replaced(final), ignore_errors=True)
    dist.barrier()


def undo_failed_save(error: BaseException, root: Path, partial: Path) -> None:
    """A save raised on every rank (collective): remove ``partial``; raise CheckpointSpaceError
    (from ``error``) when the disk filled up, else return so the caller re-raises ``error``."""
    # Judge the filesystem before the cleanup frees it again: every rank raised (the save gathers
    # failures), so the barrier orders all the checks before rank 0 removes the folder.
    full = _out_of_space(error, root)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # `latest` still names the last good checkpoint
    if full:
        free = shutil.disk_usage(root).free
        raise CheckpointSpaceError(
            f"no space left on device while writing checkpoint {partial} ({free / 2**20:.1f} MiB free there); "
            f"the partial save was removed and {root / 'latest'} still names the last good checkpoint "
            f"({latest(root).name if latest(root) else 'none yet'}). Fix: free space, or point "
            "trainer.run_dir at a larger filesystem, then resume"
        ) from error


@contextmanager
def saving(root: Path, partial: Path, final: Path):
    """The block writes ``partial`` (every rank); then ``finish_save`` puts it in place as ``final``. A
    failure undoes the save (``undo_failed_save``: CheckpointSpaceError for a full disk) and is raised."""
    try:
        yield
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            undo_failed_save(e, root, partial)
        raise
    finish_save(root, partial, final)


def rng_state() -> dict:
    """This process's RNG states: Python's, NumPy's, torch's and (on a GPU) CUDA's."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    """Put back what ``rng_state`` took (CUDA's only where this process has a GPU)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Copied from the model's folder into an HF export (the weights and config.json are written fresh).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    # a vision-language model's processor (image processor settings, the processor's own)
    "processor_config.json",
    "preprocessor_config.json",
    "chat_template.json",
)


def finish_export(partial: Path, out_dir: Path, source: Path | None) -> None:
    """An HF export written to ``partial``: the tokenizer files of ``source`` (the model's folder, if any)
    beside it, then renamed into place as ``out_dir`` (whole, or not at all)."""
    for name in TOKENIZER_FILES if source else ():
        if (source / name).exists():
            shutil.copy2(source / name, partial / name)
    _readable_as_created(partial)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)


def _readable_as_created(folder: Path) -> None:
    """Give every file under ``folder`` the permissions a plain ``open(..., "w")`` there gets (0o666 less the
    umask). Why: safetensors' ``save_file`` writes 0o600 whatever the umask (measured, safetensors 0.8), so an
    export was unreadable to the other accounts and containers that serve it, unlike the config beside it."""
    probe = folder / ".rlmega_mode_probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _replaced(final: Path) -> Path:
    """Where an older save of the same step waits while the new one is renamed in (a name that is
    neither step_N nor .partial, so no resume or prune ever takes it for a checkpoint)."""
    return final.with_name(final.name + ".replaced")


def _move_into_place(partial: Path, final: Path) -> None:
    """Rename the finished save to step_N durably. A step_N already there (a resume from an older
    checkpoint passing it again) is renamed aside first, never deleted before the new one is in:
    a crash at any point leaves a complete step_N, or the previous checkpoint for `latest` to fall
    back to (run.py resumes from the newest complete one)."""
    fsync_tree(partial)  # every rank's shards and rank 0's common files are on disk
    aside = _replaced(final)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    partial.rename(final)
    fsync_dir(final.parent)


def _out_of_space(error: BaseException, root: Path) -> bool:
    """ENOSPC anywhere in the error (torch's CheckpointException keeps per-rank failures apart from
    its cause chain, and may hold none on this rank), or a filesystem with next to nothing left."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if isinstance(e, (tuple, list)):  # failures may hold (exception, traceback) pairs
            todo += list(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    try:
        return shutil.disk_usage(root).free < 1 << 20
    except OSError:
        return False
