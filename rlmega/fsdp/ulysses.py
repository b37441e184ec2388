"""Ulysses sequence parallelism on the FSDP learner (``actor.ulysses_size``, issue 40; DeepSpeed-Ulysses, as
verl and XTuner run it).

The world's ranks form groups of U consecutive ranks; a group takes one data-parallel share of the batch, and
each of its ranks holds 1/U of every packed row (contiguous, the row padded to a multiple of U): the
embedding, the MLPs, the norms and the head see that shard only. Around attention an all-to-all trades the
sequence split for a head split: each rank attends over the WHOLE row with H/U of the heads
(``packed_attention`` then cuts the row into its sequences as without Ulysses), and a second all-to-all
trades back. RoPE is applied before, per token, from each token's own position.

As context parallelism does on the Megatron learner (rlmega/megatron/context_parallel.py), the per-token
outputs (log-probs, entropy, values) are all-gathered over the group and the loss runs on whole sequences on
every rank of it. Gradients: the gather's backward sums the U identical loss gradients, so FSDP's average
over all ranks carries a factor U, which ``FSDPEngine.normalize_grads`` divides out; metrics are summed from
one rank of each group.

    shard = Shard.of(mb, group_rank, size, group)   # this rank's part of a micro-batch
    with active(shard):                             # attention calls see it (packed_attention.py)
        hidden = model(shard.tokens, shard.position_ids)
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.distributed as dist

_ACTIVE: list = []  # the shard of the forward in progress (a stack: set only inside ``active``)


@dataclasses.dataclass
class Shard:
    """One rank's contiguous part [lo, hi) of a micro-batch's packed row of ``full_len`` positions."""

    rank: int
    size: int
    group: object
    lo: int
    hi: int
    full_len: int
    full_position_ids: torch.Tensor  # (1, full_len): the attention's sequence boundaries
    head_fields: dict

    def to_full(self, local: torch.Tensor) -> torch.Tensor:
        """Per-position values (hi - lo,) of every rank of the group -> row order (full_len,), on each rank.
        Differentiable: the backward hands each rank the sum of the group's gradients for its positions."""
        return _GatherRow.apply(local.contiguous(), self.size, self.group)


def localise(mb: dict, rank: int, size: int, group) -> dict:
    """The micro-batch with its model inputs cut to this rank's part of the row; the per-token fields stay
    whole (the loss runs on the whole row) and ``mb["ulysses"]`` holds the Shard (the head's local labels
    and scored positions included)."""
    tokens, positions = mb["tokens"], mb["position_ids"]
    if tokens.shape[0] != 1 or tokens.shape[1] % size:
        raise ValueError(
            f"Ulysses takes one packed row of a multiple of {size} tokens, got {tuple(tokens.shape)}"
        )
    per = tokens.shape[1] // size
    lo, hi = rank * per, (rank + 1) * per
    runs = [
        (max(a, lo) - lo, min(b, hi) - lo)
        for a, b in mb["response_positions"]
        if min(b, hi) > max(a, lo)
    ]
    head = {"labels": mb["labels"][lo:hi], "response_positions": runs}
    out = dict(mb)
    out["tokens"], out["position_ids"] = tokens[:, lo:hi], positions[:, lo:hi]
    out["ulysses"] = Shard(rank, size, group, lo, hi, tokens.shape[1], positions, head)
    return out


@contextmanager
def active(shard: Shard | None):
    """While open, attention calls trade the sequence split for a head split over ``shard``'s group."""
    if shard is None:
        yield
        return
    _ACTIVE.append(shard)
    try:
        yield
    finally:
        _ACTIVE.pop()


def current() -> Shard | None:
    return _ACTIVE[-1] if _ACTIVE else None


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Each rank attends with 1/U of the query heads and of the KV heads."""
    if num_heads % size or num_kv_heads % size:
        raise ValueError(
            f"actor.ulysses_size={size} must divide the model's attention heads ({num_heads}) and KV "
            f"heads ({num_kv_heads}): each rank attends with 1/ulysses_size of each"
        )


def seq_to_heads(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """(1, H, T/U, D) on each rank -> (1, H/U, T, D): this rank's heads over the whole row."""
    return _Exchange.apply(x, shard.size, shard.group, True)


def heads_to_seq(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """(1, H/U, T, D) -> (1, H, T/U, D): the inverse of ``seq_to_heads``."""
    return _Exchange.apply(x, shard.size, shard.group, False)


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all over dim 0 (slot j to rank j; slot i of the result from rank i)."""
    x = x.contiguous()
    # (of the contiguous input: empty_like keeps a permuted tensor's strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    _, H, t, D = x.shape
    send = x[0].reshape(size, H // size, t, D)  # slot j: head group j (to rank j)
    got = _a2a(send, group)  # slot i: my head group over rank i's positions
    return got.permute(1, 0, 2, 3).reshape(1, H // size, size * t, D)


def _heads_to_seq(x: torch.Tensor, size: int, group) -> torch.Tensor:
    _, h, T, D = x.shape
    # slot j: rank j's positions, my heads
    send = x[0].reshape(h, size, T // size, D).permute(1, 0, 2, 3)
    got = _a2a(send, group)  # slot i: head group i over my positions
    return got.reshape(1, size * h, T // size, D)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls (``to_heads``: sequence split -> head split); its backward is the other."""

    @staticmethod
    def forward(ctx, x, size, group, to_heads):
        ctx.size, ctx.group, ctx.to_heads = size, group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, size, group)

    @staticmethod
    def backward(ctx, grad):
        return (
            (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.size, ctx.group),
            None,
            None,
            None,
        )


class _GatherRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, size, group):
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), local.shape[0]
        out = torch.empty(size * local.shape[0], dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss reads every position
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None
