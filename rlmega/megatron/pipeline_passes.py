"""Packed-sequence forward passes and the RL train step, through Megatron's pipeline schedule.

Every pass goes through ``get_forward_backward_func()`` with Megatron's contract
``forward_step(data_iterator, model) -> (output, loss_func)``; the RL loss plugs into
``loss_func`` and returns ``(numerator, count, stats)`` so that Megatron normalises over the
whole global batch (``calculate_per_token_loss``). Micro-batches are packed rows of different
lengths, so pipeline stages exchange shapes first (``variable_seq_lengths``): nothing is padded to
the longest sequence (with VPP, rows share the longest row's length).

Attention over a packed row: without Transformer Engine (the local layer spec), causal SDPA per
sequence of each row (``packed_attention.packed_rows``); with Transformer Engine on a GPU, THD
``PackedSeqParams`` built from ``cu_seqlens``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlmega.megatron import output_head
from rlmega.megatron.hf_io import unwrap
from rlmega.megatron.model_manager import make_data_iterator_list
from rlmega.megatron.packed_attention import packed_rows, uses_packed_sdpa
from rlmega.megatron.routing_replay import RoutePass
from rlmega.megatron.runtime import for_collective
from rlmega.megatron.vocab_parallel import entropy, token_logprobs

# loss_fn(micro_batch, logprobs (T,), entropy (T,) | None) -> (numerator, count, {name: sum}), 0-dim tensors
LossFn = Callable[
    [dict, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, dict]
]


def forward_chunk(model, mb: dict, hidden: bool = False) -> torch.Tensor:
    """Logits (B*S, V/tp) of one micro-batch's packed rows (B, S), row-major like its per-token fields; with
    ``hidden``, the last hidden states (B*S, H) instead (output_head.py computes the logits in chunks)."""
    last = _is_last_stage(model)
    with output_head.hidden_out(model) if hidden and last else nullcontext():
        out = _run(model, mb)
    if not last:  # hidden states (S, B, H) (S/TP under sequence parallelism), passed on as they are
        return out
    return (output_head.full_sequence(model, out) if hidden else out).flatten(0, 1)


def _run(model, mb: dict) -> torch.Tensor:
    """The chunk's output for the micro-batch: logits (B, S, V/tp) or hidden states, as megatron-core returns."""
    device = next(model.parameters()).device
    tokens, positions = mb["tokens"].to(device), mb["position_ids"].to(device)
    extra = {}
    if unwrap(model).config.num_moe_experts:
        # MoE: padding (row tails, rows and micro-batches added to even out shapes) stays out of the
        # routers' aux / z losses and their token counts (megatron-core: (B, S) bool, True = padding);
        # routing itself, and so every output, is unchanged
        # CP: local slots
        real = (
            mb["real_tokens"] if mb.get("cp") is None else mb["cp"].take(mb["real_tokens"], False)
        )
        extra["padding_mask"] = ~real.view(tokens.shape).to(device)
        if unwrap(model).config.sequence_parallel and not unwrap(model).pre_process:
            # megatron-core scatters the mask along the sequence only where the embedding runs (the first
            # stage); a later stage's layers see this TP rank's part of the sequence (S/TP) and need it cut
            tp, rank = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank(),
            )
            extra["padding_mask"] = extra["padding_mask"].chunk(tp, dim=1)[rank]
    if uses_packed_sdpa(unwrap(model)):  # local spec: SDPA per sequence (packed_attention.py)
        with packed_rows(model, positions, mb["row_cu"], cp=mb.get("cp")) as params:
            return model(tokens, positions, None, packed_seq_params=params, **extra)
    # Transformer Engine: THD packing
    cu = mb["cu_seqlens"].to(device=device, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=mb["max_seqlen"],
        max_seqlen_kv=mb["max_seqlen"],
    )
    return model(tokens, positions, None, packed_seq_params=params, **extra)


def _is_last_stage(chunk) -> bool:
    """This model chunk computes logits (the last chunk of the last pipeline stage)."""
    return unwrap(chunk).post_process


def run_schedule(model: list, micro_batches: list[dict], step_fn, forward_only: bool) -> list[dict]:
    config = unwrap(model[0]).config
    vpp = len(model)
    # Packed rows differ in length: pipeline stages exchange shapes before each transfer.
    config.variable_seq_lengths = True
    iters = make_data_iterator_list(micro_batches, padding=True, vpp_size=vpp)
    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=iters,
        model=model if vpp > 1 else model[0],
        # megatron divides seq_length by CP for the stages' tensor shapes: rows are split over CP already
        num_microbatches=len(micro_batches),
        seq_length=micro_batches[0]["max_batch_seqlen"] * ps.get_context_parallel_world_size(),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _routed(routes: RoutePass | None, chunk, mb: dict):
    """MoE routing of this chunk's forward of this micro-batch: recorded / replayed (routing_replay)."""
    return nullcontext() if routes is None else routes.forward(chunk, mb)


def _head(
    chunk,
    output: torch.Tensor,
    mb: dict,
    vocab_size: int,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (T,), entropy (T,) or None) from the last stage's output: hidden states computed a chunk at a
    time when ``chunk_tokens`` > 0 (response positions only), else the whole logits. Under context
    parallelism the output is this rank's slots'; the results come back whole (context_parallel.py)."""
    cp = mb.get("cp")
    fields = (
        mb
        if cp is None
        else {
            k: v.to(output.device) if torch.is_tensor(v) else v for k, v in cp.head_fields.items()
        }
    )
    if chunk_tokens > 0:
        lp, ent = output_head.logprobs(
            chunk, output, fields, vocab_size, temperature, chunk_tokens, with_entropy, entropy_grad
        )
    else:
        lp = token_logprobs(output, fields["labels"].to(output.device), vocab_size, temperature)
        ent = None
        if with_entropy:
            # no graph when only a metric
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy(output, vocab_size, temperature)
    if cp is not None:
        lp, ent = cp.to_full(lp), None if ent is None else cp.to_full(ent)
    return lp, ent


@torch.no_grad()
def forward_logprobs(
    model: list,
    micro_batches: list[dict],
    vocab_size: int,
    temperature: float,
    with_entropy: bool = False,
    routes: RoutePass | None = None,
    chunk_tokens: int = 0,
) -> list[dict] | None:
    """Per micro-batch {"logprobs": (T,), "entropy": (T,)} (on the model's device) on the last stage; None elsewhere.

    ``routes``: MoE routing replay / recording of this pass (set per micro-batch and chunk, in the forward step).
    ``chunk_tokens`` > 0: the response positions only (0 elsewhere), without the whole logits (output_head.py).
    """

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        with _routed(routes, chunk, mb):
            logits = forward_chunk(chunk, mb, hidden=chunk_tokens > 0)

        def collect(output):
            lp, ent = _head(
                chunk, output, mb, vocab_size, temperature, chunk_tokens, with_entropy, False
            )
            out = {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}
            # on the device: no sync per micro-batch
            return output.sum() * 0.0, torch.ones((), dtype=torch.int), out

        return logits, collect

    outs = run_schedule(model, micro_batches, step, forward_only=True)
    return outs if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def train_micro_batches(
    model: list,
    micro_batches: list[dict],
    vocab_size: int,
    temperature: float,
    loss_fn: LossFn,
    with_entropy: bool,
    entropy_grad: bool = True,
    keep_logprobs: bool = False,
    routes: RoutePass | None = None,
    chunk_tokens: int = 0,
) -> list[dict] | None:
    """Forward + backward of all micro-batches (gradients land in Megatron DDP's buffers).

    Returns each micro-batch's stats (sums) on the last pipeline stage, None elsewhere.
    ``entropy_grad`` False: the entropy is only a metric, computed without building its graph.
    ``keep_logprobs``: each micro-batch's stats also hold "logprobs" (T,), this forward's
    log-probs, detached (float32), as ``forward_logprobs`` returns them. All on the model's device.
    ``routes``: as in ``forward_logprobs`` (no router runs again in the backward: no recomputation; the
    output layer's chunks are recomputed, ``chunk_tokens`` as in ``forward_logprobs``).
    """

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        with _routed(routes, chunk, mb):
            logits = forward_chunk(chunk, mb, hidden=chunk_tokens > 0)

        def loss(output):
            fields = per_token_on(mb, output.device)
            lp, ent = _head(
                chunk,
                output,
                fields,
                vocab_size,
                temperature,
                chunk_tokens,
                with_entropy,
                entropy_grad,
            )
            numerator, count, stats = loss_fn(fields, lp, ent)
            # Everything stays on the device (the caller sums over micro-batches, then copies once):
            # reading a number here would make the host wait for the device every micro-batch.
            stats = {
                k: torch.as_tensor(v, dtype=torch.float64, device=output.device).detach()
                for k, v in stats.items()
            }
            stats["numerator"] = numerator.detach().double()
            stats["count"] = count.detach().double()
            if keep_logprobs:
                stats["logprobs"] = lp.detach()
            return numerator, count.detach().round().int(), stats

        return logits, loss

    outs = run_schedule(model, micro_batches, step, forward_only=False)
    return outs if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def _values(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """A value head's output (T, 1) -> (T,) float32 (Float16Module hands it back in fp32 already); whole
    under context parallelism (context_parallel.py)."""
    values = output[:, 0].float()
    return values if mb.get("cp") is None else mb["cp"].to_full(values)


@torch.no_grad()
def forward_values(model: list, micro_batches: list[dict]) -> list[dict] | None:
    """Per micro-batch {"values": (T,)} of a value model (rlmega/megatron/value_head.py) on the last
    stage; None elsewhere."""

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        output = forward_chunk(chunk, mb)

        def collect(out):
            return out.sum() * 0.0, torch.ones((), dtype=torch.int), {"values": _values(out, mb)}

        return output, collect

    outs = run_schedule(model, micro_batches, step, forward_only=True)
    return outs if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def train_values(model: list, micro_batches: list[dict], loss_fn) -> list[dict] | None:
    """``train_micro_batches`` of a value model: ``loss_fn(fields, values (T,))`` -> (numerator, count,
    stats); each micro-batch's stats (sums, float64 on the device) on the last stage, None elsewhere."""

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        output = forward_chunk(chunk, mb)

        def loss(out):
            fields = per_token_on(mb, out.device)
            numerator, count, stats = loss_fn(fields, _values(out, mb))
            stats = {
                k: torch.as_tensor(v, dtype=torch.float64, device=out.device).detach()
                for k, v in stats.items()
            }
            stats["numerator"], stats["count"] = (
                numerator.detach().double(),
                count.detach().double(),
            )
            return numerator, count.detach().round().int(), stats

        return output, loss

    outs = run_schedule(model, micro_batches, step, forward_only=False)
    return outs if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def per_token_on(mb: dict, device) -> dict:
    """The micro-batch with its flat per-token fields (labels, masks, advantages, ...) on ``device``."""
    return {k: v.to(device) if torch.is_tensor(v) and v.dim() == 1 else v for k, v in mb.items()}


def share_from_last_stage(values: torch.Tensor | None, numel: int) -> torch.Tensor:
    """The last pipeline stage's flat float tensor (float64, on the host), on every stage of this pipeline.

    The broadcast runs on the collective's device (``runtime.for_collective``): NCCL on GPUs.
    """
    pp = ps.get_pipeline_model_parallel_world_size()
    if values is None:
        values = torch.empty(numel, dtype=torch.float64)
    values = values.double()
    if pp > 1:
        group = ps.get_pipeline_model_parallel_group()
        values = for_collective(values, group)
        dist.broadcast(values, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return values.cpu()


def all_gather_data_parallel(obj) -> list:
    """One Python object from each data-parallel rank, in DP-rank order, on every rank.

    Host objects travel over Megatron's gloo copy of the data-parallel group (created by
    ``initialize_model_parallel``), so NCCL never sees host tensors and no device copy is made.
    """
    group = ps.get_data_parallel_group_gloo()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def sum_over_data_parallel(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over data-parallel ranks; float64 on the host."""
    group = ps.get_data_parallel_group()
    values = for_collective(values.double(), group)
    dist.all_reduce(values, group=group)
    return values.cpu()
