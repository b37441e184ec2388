"""A plain next-token language-model step on Megatron GPT chunks, any TP/PP/VPP layout.

This is the smallest real workload that exercises every moving part the RL learner relies on:
model chunks per virtual pipeline stage, Megatron DDP, the distributed optimizer and Megatron's
own pipeline schedule (``get_forward_backward_func``). The foundation's invariance tests and the
pre-trainer ``make demo`` run it; the RL actor replaces the loss, not the machinery.

Call order on every rank (after ``runtime.init_megatron``):
    mm = MegatronModelManager(...); mm.setup_model_and_optimizer()
    loss = lm_forward_backward(mm.model, tokens, micro_batch_size)  # (B, T+1) int64 token ids
    ok, grad_norm, lr = mm.optimizer_step()
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlmega.megatron.model_manager import make_data_iterator_list
from rlmega.megatron.packed_attention import packed_rows
from rlmega.megatron.runtime import for_collective


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Summed next-token loss of one micro-batch and its token count. output, loss_mask: (b, t).

    Megatron's per-token contract (3-tuple): it sums numerators and counts over micro-batches
    and data-parallel ranks and scales gradients by 1 / total count: a global token mean.
    """
    total = (output.float() * loss_mask).sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.detach().float()])}


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)  # (b, t+1)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    b, t = inputs.shape
    position_ids = torch.arange(t, device=inputs.device).unsqueeze(0).expand(b, t)
    with packed_rows(model, position_ids, [[0, t]] * b) as params:  # each row one causal sequence
        # (b, t) losses
        output = model(inputs, position_ids, None, packed_seq_params=params, labels=labels)
    return output, partial(_loss, torch.ones_like(labels, dtype=torch.float32))


def lm_forward_backward(
    model: list, tokens: torch.Tensor, micro_batch_size: int, forward_only: bool = False
) -> float:
    """Forward (+backward) one global batch of this DP rank; returns the mean loss on all ranks.

    tokens: (B, T+1) int64, this data-parallel rank's share of the global batch.
    """
    num_micro = tokens.shape[0] // micro_batch_size
    if num_micro * micro_batch_size != tokens.shape[0]:
        raise ValueError(
            f"batch of {tokens.shape[0]} rows is not divisible by micro_batch_size={micro_batch_size}"
        )
    micro = list(tokens.split(micro_batch_size))
    vpp = len(model)
    iters = make_data_iterator_list(micro, vpp_size=vpp)  # each model chunk pulls every micro-batch
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iters,
        model=model if vpp > 1 else model[0],
        num_microbatches=num_micro,
        seq_length=tokens.shape[1] - 1,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    # Losses exist on the last pipeline stage only; average them, then over data parallel,
    # and hand the number to every rank so callers need no rank arithmetic.
    total = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        total += torch.stack([d["lm loss"] for d in losses]).double().sum(0).cpu()
    total = for_collective(total)  # NCCL on GPUs: reduce on the device
    dist.all_reduce(total)  # sums over pipeline stages (non-last add 0), TP copies and DP
    return float(total[0] / total[1])


def _logits_step(data_iterator, model):
    tokens = next(data_iterator)  # (b, t)
    b, t = tokens.shape
    position_ids = torch.arange(t, device=tokens.device).unsqueeze(0).expand(b, t)
    with packed_rows(model, position_ids, [[0, t]] * b) as params:
        logits = model(tokens, position_ids, None, packed_seq_params=params)  # (b, t, vocab / tp)

    def keep(output):
        return (
            output.sum() * 0.0,
            torch.ones((), dtype=torch.int),
            {"logits": output.detach().clone()},
        )

    return logits, keep


@torch.no_grad()
def forward_logits(
    model: list, tokens: torch.Tensor, micro_batch_size: int = 1
) -> torch.Tensor | None:
    """Full-vocabulary logits (B, T, padded vocab) on the last pipeline stage, None elsewhere.

    Gathers the TP-sharded vocabulary: for checks and exports only; the learner computes
    log-probs without gathering.
    """
    num_micro = tokens.shape[0] // micro_batch_size
    micro = list(tokens.split(micro_batch_size))
    vpp = len(model)
    outputs = get_forward_backward_func()(
        forward_step_func=_logits_step,
        data_iterator=make_data_iterator_list(micro, vpp_size=vpp),
        model=model if vpp > 1 else model[0],
        num_microbatches=num_micro,
        seq_length=tokens.shape[1],
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = torch.cat([o["logits"] for o in outputs])
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)
