"""Writes that survive a crash or power loss: a reader finds the old content or the new, never a mix.

A rename is only durable once its folder is fsynced, and a renamed file's bytes only once the file
itself was; both steps are here so the metrics file, config.yaml and checkpoints' `latest` share them.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder ``path`` (renames, new and deleted files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file and folder under ``path`` (a finished checkpoint, before it is renamed into place)."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)


def replace_durably(path: str | Path, text: str) -> None:
    """Put ``text`` at ``path``: write a temporary file, fsync it, rename it over, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
