"""One weight-sync pipeline for every learner backend: a trainer rank's HF tensors, bucketed, through a transport.

    sent = stream_weights(tensors, transport, version, bucket_bytes, sender)

``tensors`` is what the rank's engine yields (rlmega.learner.engine_api.TrainEngine.weights_out): (HF name,
tensor or Piece) in the model's order, gathered one parameter at a time, so only the bucket being filled
is ever held in full. Every rank iterates it to the end (the gathers are collectives); the sender hands
each bucket to the transport (rlmega/sync/transports.py), the others only take part in the gathers.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from rlmega.sync.pieces import Piece


def buckets(
    tensors: Iterable, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor | Piece]]]:
    """``tensors`` grouped into lists of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    bucket, size = [], 0
    for name, value in tensors:
        nbytes = value.nbytes
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, value))
        size += nbytes
    if bucket:
        yield bucket


def stream_weights(
    tensors: Iterable, transport, version: int, bucket_bytes: int, sender: bool
) -> dict:
    """Send ``tensors`` (when ``sender``) to the engines through ``transport`` as weights ``version``, in
    buckets of at most ``bucket_bytes``; ``flush`` at the end (every bucket loaded). The transport's
    ``begin`` (when it has one) opens the engines' reload before the first bucket is gathered.

    Returns what this rank did: ``gathered`` tensors, and sent ``bytes``, ``tensors`` (a piece counts as
    one), ``buckets`` and ``names_and_shapes`` [(name, shape)] (a piece: its HF tensor's whole shape)."""
    sent = {"gathered": 0, "bytes": 0, "tensors": 0, "buckets": 0, "names_and_shapes": []}
    if sender and hasattr(transport, "begin"):
        transport.begin(version, 0)  # the engines' reloads start while the first bucket is gathered
    for bucket in buckets(tensors, bucket_bytes):
        sent["gathered"] += len(bucket)
        if not sender:
            continue  # this rank only took part in the gathers
        transport.send(bucket, version)
        sent["buckets"] += 1
        for name, t in bucket:
            sent["tensors"] += 1
            sent["bytes"] += t.nbytes  # (a piece's: its block's)
            sent["names_and_shapes"].append(
                (name, tuple(t.full_shape if isinstance(t, Piece) else t.shape))
            )
    if sender:
        transport.flush()  # a pipelined transport may still be loading the last buckets
    return sent
