"""Context parallelism (``parallelism.context_parallel_size``, CP) on the Megatron learner (issue 40).

A micro-batch's packed row is split over the CP ranks of its data-parallel rank. Every causal segment of
the row (each sequence, and the row's padding tail) is cut into 2 x CP chunks, and CP rank r holds
chunks r and 2CP-1-r of each: the early chunk attends to little, the late one to much, so every rank
does about the same attention work (the load-balanced layout of Megatron and Transformer Engine). A
segment's chunks may be uneven or empty (its length need not divide by 2 x CP): the attention below is
rlmega's own, so a short sequence costs nothing but balance.

    layout = cp_layout(segments, cp, rank, multiple)   # which row positions this rank holds
    mb = localise(mb, cp, rank, multiple)              # the micro-batch's model inputs, this rank's part

Three things then differ from a run without CP:
- **Attention** (``CPShare.attend``, which packed_attention.PackedSDPAttention calls through its RowPacking):
  K and V are all-gathered over the CP group (the gather's backward reduce-scatters their gradients), put
  back in row order, and each local chunk attends to its segment's keys up to the chunk's end: causal,
  aligned lower-right.
- **Outputs**: the log-probs (entropy, values) each rank computes at its own positions are all-gathered
  over CP and put back in row order (``CPShare.to_full``), so every CP rank holds the whole micro-batch's
  per-token outputs. The loss then runs on the whole micro-batch, as without CP: sequence-level
  aggregation, GSPO and sequence-level rollout correction see whole sequences.
- **Normalisation**: every CP rank returns the whole numerator and count. Megatron sums the count over
  DP x CP (CP x the true count) and the gradients too; each rank's gradient is CP x its share (the
  output gather's backward sums the CP identical loss gradients), so the ratio is the true one.
  Metrics sum over DP only (each CP rank holds the same sums).

Positions come from each token's position in its own sequence, so RoPE needs nothing more.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from rlmega.megatron.packed_attention import row_segments


@dataclasses.dataclass
class CPShare:
    """One CP rank's share of one packed row of ``full_len`` positions.

    ``local_idx`` (S_local,) int64: the row position each local slot holds, -1 on padding slots (the local
    row is padded to the longest rank's share, rounded up to ``multiple``).
    ``full_from_gathered`` (full_len,) int64: where row position t sits in the CP all-gather of every
    rank's local row (rank q's slot l at q * S_local + l).
    ``queries``: the local row as (local start, length, key start, key end) pieces in order: the local
    positions [start, start + length) attend to row positions [key start, key end) (their segment, up to
    the chunk's end); key start -1 for the padding slots, which attend among themselves.
    """

    local_idx: torch.Tensor
    full_from_gathered: torch.Tensor
    queries: list[tuple[int, int, int, int]]
    full_len: int
    head_fields: dict = dataclasses.field(default_factory=dict)

    @property
    def local_len(self) -> int:
        return self.local_idx.numel()

    def take(self, full: torch.Tensor, pad=0) -> torch.Tensor:
        """A row-order per-position tensor (full_len, ...) -> this rank's slots (S_local, ...), ``pad`` on
        padding slots."""
        idx = self.local_idx.to(full.device)
        out = full[idx.clamp(min=0)]
        return out.masked_fill((idx < 0).view(-1, *[1] * (full.dim() - 1)), pad)

    def to_full(self, local: torch.Tensor) -> torch.Tensor:
        """Per-slot values (S_local,) of every CP rank -> row order (full_len,), on every CP rank.

        Differentiable: the gather's backward sums the gradient each rank's copy receives (reduce-scatter),
        which is what the normalisation above relies on."""
        gathered = gather_from_sequence_parallel_region(
            local.contiguous(),
            tensor_parallel_output_grad=True,
            group=ps.get_context_parallel_group(),
        )
        return gathered[self.full_from_gathered.to(local.device)]

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        dropout: float,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries over their segments' keys on every CP rank.

        query (S_local, 1, H, D), key/value (S_local, 1, G, D), RoPE applied -> (S_local, H, D)."""
        if dropout:
            raise ValueError(
                "context parallelism: attention dropout is not supported (RL runs without it)"
            )
        group = ps.get_context_parallel_group()
        # (full_len, G, D)
        whole_k, whole_v = (
            gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)[
                self.full_from_gathered.to(t.device), 0
            ]
            for t in (key, value)
        )
        q, k, v = query[:, 0], key[:, 0], value[:, 0]
        # GQA: each group's heads
        heads = (
            (lambda t: t)
            if q.shape[1] == k.shape[1]
            else (lambda t: t.repeat_interleave(q.shape[1] // t.shape[1], dim=1))
        )
        outs = []
        for start, length, k_lo, k_hi in self.queries:
            qs = q[start : start + length].transpose(0, 1)[None]  # (1, H, n, D)
            if k_lo < 0:  # padding slots: among themselves
                ks, vs = k[start : start + length], v[start : start + length]
                o = F.scaled_dot_product_attention(
                    qs,
                    *(heads(t).transpose(0, 1)[None] for t in (ks, vs)),
                    is_causal=True,
                    scale=scale,
                )
            else:
                # (1, H, m, D)
                ks, vs = (heads(t[k_lo:k_hi]).transpose(0, 1)[None] for t in (whole_k, whole_v))
                o = prefix_causal_attention(qs, ks, vs, scale)
            outs.append(o[0].transpose(0, 1))  # (n, H, D)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _pieces(
    segments: list[int], cp: int, rank: int
) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(row positions, query pieces with local starts) of CP rank ``rank``, before padding."""
    positions, queries, start = [], [], 0
    for length in segments:
        bounds = [start + (k * length) // (2 * cp) for k in range(2 * cp + 1)]
        for k in (rank, 2 * cp - 1 - rank):
            lo, hi = bounds[k], bounds[k + 1]
            if hi > lo:
                queries.append((len(positions), hi - lo, start, hi))
                positions += range(lo, hi)
        start += length
    return positions, queries


def share_length(segments: list[int], cp: int, multiple: int = 1, at_least: int = 0) -> int:
    """The local row's length of every CP rank over a row of causal ``segments``: the longest rank's share,
    at least ``at_least``, rounded up to a multiple of ``multiple`` (TP under sequence parallelism)."""
    longest = max(at_least, max(len(_pieces(segments, cp, r)[0]) for r in range(cp)))
    return max(multiple, -(-longest // multiple) * multiple)


def cp_layout(
    segments: list[int], cp: int, rank: int, multiple: int = 1, at_least: int = 0
) -> CPShare:
    """The layout of CP rank ``rank`` over one row whose causal segments have lengths ``segments``
    (sequences, then the padding tail: packed_attention.row_segments). The local row is
    ``share_length(segments, cp, multiple, at_least)`` long."""
    shares = [_pieces(segments, cp, r) for r in range(cp)]
    local_len = share_length(segments, cp, multiple, at_least)
    full_len = sum(segments)
    full_from_gathered = torch.empty(full_len, dtype=torch.int64)
    for r, (positions, _) in enumerate(shares):
        full_from_gathered[positions] = r * local_len + torch.arange(len(positions))
    positions, queries = shares[rank]
    pad = local_len - len(positions)
    if pad:
        queries = queries + [(len(positions), pad, -1, -1)]
    local_idx = torch.tensor(positions + [-1] * pad, dtype=torch.int64)
    return CPShare(local_idx, full_from_gathered, queries, full_len)


def mb_segments(mb: dict) -> list[int]:
    """The causal segments of a packed micro-batch's one row (row_segments)."""
    B, S = mb["tokens"].shape
    if B != 1:
        raise ValueError(f"context parallelism takes one packed row per micro-batch, got {B} rows")
    return row_segments(mb["row_cu"], 1, S)


def longest_over_data_parallel(lengths: list[int]) -> list[int]:
    """Element-wise max of every data-parallel rank's ``lengths`` (as many on each), over the host group."""
    group = ps.get_data_parallel_group_gloo()
    if dist.get_world_size(group) == 1:
        return lengths
    t = torch.tensor(lengths, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def localise(mb: dict, cp: int, rank: int, multiple: int = 1, at_least: int = 0) -> dict:
    """A packed micro-batch (one row) with its model inputs (``tokens``, ``position_ids``) cut to CP rank
    ``rank``'s share (``at_least`` slots: cp_layout); the per-token fields stay whole (the loss runs on the
    whole row) and ``mb["cp"]`` holds the CPShare, with the head's local fields (labels and the scored runs
    of local slots)."""
    S = mb["tokens"].shape[1]
    layout = cp_layout(mb_segments(mb), cp, rank, multiple, at_least)
    scored = torch.zeros(S, dtype=torch.bool)
    for a, b in mb["response_positions"]:
        scored[a:b] = True
    local_scored = layout.take(scored, False).tolist()
    runs, start = [], None
    for i, s in enumerate(local_scored + [False]):
        if s and start is None:
            start = i
        elif not s and start is not None:
            runs.append((start, i))
            start = None
    layout.head_fields = {"labels": layout.take(mb["labels"]), "response_positions": runs}
    out = dict(mb)
    out["tokens"] = layout.take(mb["tokens"][0])[None]
    out["position_ids"] = layout.take(mb["position_ids"][0])[None]
    out["cp"] = layout
    return out


def prefix_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention aligned lower-right: q (1, H, n, D) are the last n positions of the m keys/values
    (1, H, m, D); query i sees keys 0 .. m - n + i. -> (1, H, n, D).

    n == m is plain causal. Otherwise, on CUDA, torch's CausalBias (its flash / efficient kernels take the
    lower-right alignment without a mask); on CPU the mask would be materialised (n x m per layer, kept for
    the backward: more than CP saves at 16k tokens), so there the keys before the queries (all visible) and
    the queries' own block (plain causal) are two flash calls merged by their log-sum-exps
    (``_PrefixThenCausal``), with no mask at all.
    """
    n, m = q.shape[2], k.shape[2]
    if n == m:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(n, m), scale=scale
        )
    return _PrefixThenCausal.apply(
        q, k[:, :, : m - n], v[:, :, : m - n], k[:, :, m - n :], v[:, :, m - n :], scale
    )


class _PrefixThenCausal(torch.autograd.Function):
    """softmax over [prefix keys | own keys (causal)] from two flash-attention calls on CPU.

    Forward: each part's output o_i and log-sum-exp l_i; l = logaddexp(l_1, l_2), o = sum_i e^(l_i - l) o_i
    (in float32 at least). Backward: flash attention's backward of each part given the *combined* o and l
    computes that part's share of the true softmax's gradient (its probabilities e^(s - l), its D = rowsum(dO
    o)), as ring attention does; the query's gradients add up."""

    @staticmethod
    def forward(ctx, q, k_pre, v_pre, k_own, v_own, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, k_pre, v_pre, 0.0, False, scale=scale)
        o2, l2 = flash(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)  # (1, H, n) float32
        acc = torch.promote_types(q.dtype, torch.float32)
        out = (
            (l1 - lse).exp().unsqueeze(-1) * o1.to(acc)
            + (l2 - lse).exp().unsqueeze(-1) * o2.to(acc)
        ).to(q.dtype)
        ctx.save_for_backward(q, k_pre, v_pre, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_pre, v_pre, k_own, v_own, out, lse = ctx.saved_tensors
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        dq1, dk_pre, dv_pre = back(grad_out, q, k_pre, v_pre, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk_own, dv_own = back(grad_out, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dk_pre, dv_pre, dk_own, dv_own, None
