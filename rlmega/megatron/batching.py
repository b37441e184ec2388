"""A whole RolloutBatch -> this rank's packed micro-batches, and per-token results back to the whole batch.

Shared by MegatronActor and MegatronCritic: every rank receives the same full batch, each data-parallel
rank works on its balanced share, and every rank returns the same full per-sample result.
"""
from __future__ import annotations

import torch

from rlmega.data.micro_batches import build_micro_batch, micro_batch_shape, scatter_responses
from rlmega.data.packing import padding_efficiency, plan_micro_batches
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.megatron import policy
from rlmega.megatron.runtime import data_parallel_rank_and_size


def plan(manager, batch: RolloutBatch, max_tokens: int, pp: int) -> tuple[list[dict], float]:
    """This DP rank's packed micro-batches of at most ``max_tokens`` tokens for ``manager``'s model
    (a MegatronModelManager; ``pp`` its pipeline size), and the padding efficiency of the whole plan."""
    dp_rank, dp = data_parallel_rank_and_size()
    # Megatron's interleaved schedule needs the micro-batch count to be a multiple of PP.
    multiple = pp if manager.vpp > 1 else 1
    # allow_empty: a short batch (fewer samples than ranks) gives a rank placeholders that add
    # nothing to the loss but keep it in the schedule's and the optimizer's collectives
    lengths = batch.lengths()
    planned = plan_micro_batches(lengths, max_tokens, dp, multiple_of=multiple, allow_empty=True)
    shapes = [None] * len(planned[dp_rank])
    if manager.transformer_config.expert_model_parallel_size > 1:
        # Every MoE layer's token dispatch is a collective over the expert-parallel group (part of
        # the data-parallel ranks): each rank runs as many micro-batches (placeholders fill in),
        # and with the allgather dispatcher (CPU) of one shape (it gathers equal blocks).
        count = max(len(p) for p in planned)
        planned = [p + [[]] * (count - len(p)) for p in planned]
        if not manager.use_te and manager.transformer_config.moe_token_dispatcher_type == "allgather":
            per_rank = [[micro_batch_shape(lengths, idx) for idx in p] for p in planned]
            shapes = [tuple(max(s[j][d] for s in per_rank) for d in (0, 1)) for j in range(count)]
        else:
            shapes = [None] * count
    mbs = [build_micro_batch(batch, idx, min_shape=shape) for idx, shape in zip(planned[dp_rank], shapes)]
    return mbs, padding_efficiency(lengths, planned)


def gather_responses(mbs: list[dict], outs: list[dict] | None, key: str, batch: RolloutBatch) -> list[torch.Tensor]:
    """Per-token values ``key`` of this rank's micro-batches (``outs``: the last pipeline stage's, None
    elsewhere) -> the full batch's per-sample float32 list, on every rank."""
    order = [i for mb in mbs for i in mb["indices"]]
    all_lens = batch.response_lens()  # once: it walks the whole batch
    lens = [all_lens[i] for i in order]
    flat = None
    if outs is not None:
        pieces = {}
        for mb, out in zip(mbs, outs):
            pieces.update(scatter_responses(out[key], mb))
        flat = torch.cat([pieces[i] for i in order]) if order else torch.zeros(0)
    flat = policy.share_from_last_stage(flat, sum(lens)).float()
    mine = dict(zip(order, flat.split(lens)))
    merged = {}
    for part in policy.all_gather_data_parallel(mine):
        merged.update(part)
    return [merged[i] for i in range(len(batch))]
