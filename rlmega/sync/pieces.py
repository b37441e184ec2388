"""Weights sent in pieces: each TP rank sends its own block of an HF tensor, the engine side places them.

Why: gathering a stage's TP shards to one sender cost that sender a receive and a re-layout of the
whole stage, and on a CPU node those are most of a sync's work beyond the engine's own reload
(docs/rollout_engine.md: at TP2xPP2 on 2 cores, 0.23-0.26 of 0.54-0.57 core-seconds). Sent as pieces,
each TP rank puts only its own rows or columns, nobody gathers, and the RolloutWorker copies each
piece straight to its place in the shared-memory slot the engine reads (the one copy it made anyway).

    Piece       one rank's block of one HF tensor: the block, the whole tensor's shape, the dimension
                it is cut along, where the block starts, and how many pieces make the tensor
    Assembled   an HF tensor whose pieces have all come: shape, dtype, nbytes like a tensor, written
                into its destination piece by piece (``write_into``), or built (``tensor``)
    Assembler   the engine side: holds pieces until their tensor is complete (thread-safe)

Which block of which HF tensor a Megatron shard is: rlmega/megatron/hf_weights.py ``hf_pieces``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import torch


@dataclasses.dataclass
class Piece:
    tensor: torch.Tensor  # contiguous; the block itself
    full_shape: tuple[int, ...]  # the HF tensor's
    # the block is full[start:start + tensor.shape[dim]] along this dimension, whole along the others
    dim: int
    start: int
    of: int  # pieces that make the tensor (the TP size); every one is sent, empty ones too

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


class Assembled:
    """An HF tensor given as its pieces (their blocks tile it exactly; checked by ``Assembler``)."""

    def __init__(self, name: str, pieces: list[Piece]):
        self.name, self.pieces = name, pieces
        self.shape = torch.Size(pieces[0].full_shape)
        self.dtype = pieces[0].dtype
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def write_into(self, dst: torch.Tensor) -> None:
        """Copy every piece to its place in ``dst`` (the tensor's bytes: uint8, contiguous, ``nbytes`` long)."""
        whole = dst.view(self.dtype).view(self.shape)
        for p in self.pieces:
            if p.tensor.numel():
                whole.narrow(p.dim, p.start, p.tensor.shape[p.dim]).copy_(p.tensor)

    def tensor(self) -> torch.Tensor:
        """The whole tensor, built (a copy: where no destination is at hand)."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.write_into(out)
        return out.view(self.dtype).view(self.shape)


class Assembler:
    """Pieces held until all of their tensor's have come, from any bucket, sender or thread.

    Keyed by weights version: a late block of a failed sync's version never completes (nor mixes
    into) the next sync's tensor.
    """

    def __init__(self):
        # (version, name) -> (piece, sender)s
        self._held: dict[tuple[int, str], list[tuple[Piece, Any]]] = {}
        self._lock = threading.Lock()
        # of the pieces held now (zero-copy views pin their object-store buffers)
        self.held_bytes = 0
        self._held_by: dict[Any, int] = {}  # the same per sender

    def add(
        self, named: list[tuple[str, Any]], version: int, sender: Any = None
    ) -> list[tuple[str, Any]]:
        """``named`` with its pieces taken out; the tensors they complete added as ``Assembled``."""
        out = []
        with self._lock:
            for name, value in named:
                if not isinstance(value, Piece):
                    out.append((name, value))
                    continue
                held = self._held.setdefault((version, name), [])
                held.append((value, sender))
                self._count(value, sender, +1)
                if len(held) == value.of:
                    del self._held[(version, name)]
                    for p, by in held:
                        self._count(p, by, -1)
                    out.append((name, _checked(name, [p for p, _ in held])))
        return out

    def holds(self, sender: Any) -> int:
        """Bytes of ``sender``'s pieces still waiting for other ranks'."""
        with self._lock:
            return self._held_by.get(sender, 0)

    def _count(self, piece: Piece, sender: Any, sign: int) -> None:
        self.held_bytes += sign * piece.nbytes
        left = self._held_by.get(sender, 0) + sign * piece.nbytes
        if left:
            self._held_by[sender] = left
        else:
            self._held_by.pop(sender, None)

    def pending(self, version: int | None = None) -> list[str]:
        """Names of tensors (of weights ``version``, or any) some of whose pieces have come, not all."""
        with self._lock:
            return sorted(n for v, n in self._held if version is None or v == version)

    def drop_older(self, version: int) -> None:
        """Drop what is held for versions before ``version`` (their syncs are over)."""
        with self._lock:
            for key in [k for k in self._held if k[0] < version]:
                for p, by in self._held.pop(key):
                    self._count(p, by, -1)

    def clear(self) -> None:
        """Drop what is held (a sync ended: what still waits belongs to none that will finish)."""
        with self._lock:
            self._held.clear()
            self.held_bytes = 0
            self._held_by.clear()


def _checked(name: str, pieces: list[Piece]) -> Assembled:
    """The pieces as one tensor, once they are seen to tile it exactly (a sender bug otherwise)."""
    first = pieces[0]
    for p in pieces:
        if (tuple(p.full_shape), p.dim, p.dtype, p.of) != (
            tuple(first.full_shape),
            first.dim,
            first.dtype,
            first.of,
        ):
            raise ValueError(
                f"pieces of {name!r} disagree: shape {tuple(p.full_shape)} vs {tuple(first.full_shape)}, "
                f"dim {p.dim} vs {first.dim}, dtype {p.dtype} vs {first.dtype}"
            )
        want = list(first.full_shape)
        want[p.dim] = p.tensor.shape[p.dim] if p.tensor.dim() == len(want) else -1
        if (
            list(p.tensor.shape) != want
            or p.start < 0
            or p.start + want[p.dim] > first.full_shape[p.dim]
        ):
            raise ValueError(
                f"a piece of {name!r} of shape {tuple(p.tensor.shape)} at {p.start} along dim {p.dim} "
                f"does not fit the whole {tuple(first.full_shape)}"
            )
    spans = sorted((p.start, p.start + p.tensor.shape[p.dim]) for p in pieces if p.tensor.numel())
    covered = 0
    for lo, hi in spans:
        if lo != covered:
            raise ValueError(
                f"the pieces of {name!r} along dim {first.dim} leave a gap or overlap at "
                f"{min(lo, covered)} (blocks {spans} of {first.full_shape[first.dim]})"
            )
        covered = hi
    if covered != first.full_shape[first.dim]:
        raise ValueError(
            f"the pieces of {name!r} cover {covered} of {first.full_shape[first.dim]} "
            f"along dim {first.dim}"
        )
    return Assembled(name, sorted(pieces, key=lambda p: p.start))
