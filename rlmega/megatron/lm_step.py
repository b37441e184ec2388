"""A plain next-token language-model step on Megatron GPT chunks, any TP/PP/VPP layout.

This is the smallest real workload that exercises every moving part the RL learner relies on:
model chunks per virtual pipeline stage, Megatron DDP, the distributed optimizer and Megatron's
own pipeline schedule (``get_forward_backward_func``). The foundation's invariance tests and the
pre-trainer ``make demo`` run it; the RL actor replaces the loss, not the machinery.

Call order on every rank (after ``runtime.init_megatron``):
    chunks = build_gpt_chunks(cfg, vocab_size, seq_len)      # raw modules, load weights here
    model, opt = wrap_for_training(chunks, lr=...)             # DDP + distributed optimizer
    loss = lm_forward_backward(model, tokens, micro_batch_size)  # (B, T+1) int64 token ids
    ok, grad_norm, _ = opt.step()
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

# Fusions are CUDA kernels; off everywhere we run the local (non-TE) spec.
CPU_SAFE = dict(
    gradient_accumulation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_activation_fusion=False,
)


def gpt_config(
    num_layers: int = 4,
    hidden_size: int = 128,
    num_attention_heads: int = 2,
    num_query_groups: int = 2,
    ffn_hidden_size: int = 256,
    vpp: int | None = None,
    params_dtype: torch.dtype = torch.float32,
) -> TransformerConfig:
    """A Llama-shaped (RMSNorm, SwiGLU, RoPE, no bias) config sized for tests and the demo."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        # Interleaved schedules need this; 1F1B ignores it. pp is the usual group size.
        microbatch_group_size_per_vp_stage=pp if vpp and vpp > 1 else None,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        use_cpu_initialization=True,
        **CPU_SAFE,
    )


def build_gpt_chunks(config: TransformerConfig, vocab_size: int, max_seq_len: int) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage this rank holds (a list of one without VPP).

    Each chunk knows whether it holds the embedding (first stage) or the output head (last).
    """
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=vocab_size,
                max_sequence_length=max_seq_len,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=False,
                position_embedding_type="rope",
                vp_stage=stage,
            )
        )
    return chunks


def wrap_for_training(chunks: list[GPTModel], lr: float = 1e-3, clip_grad: float = 1.0,
                      weight_decay: float = 0.0, distributed_optimizer: bool = True):
    """Megatron DDP around each chunk, and the (distributed) Adam optimizer over all of them."""
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer,
    )
    model = [
        # Only the first chunk buckets its grads: the others' reductions are issued by the
        # schedule in order, as Megatron's own training loop does.
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
        use_distributed_optimizer=distributed_optimizer, params_dtype=config.params_dtype,
        bf16=config.params_dtype == torch.bfloat16,
    )
    return model, get_megatron_optimizer(opt_config, model)


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean next-token loss of one micro-batch. output, loss_mask: (b, t)."""
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)  # (b, t+1)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    b, t = inputs.shape
    position_ids = torch.arange(t, device=inputs.device).unsqueeze(0).expand(b, t)
    # Local-spec attention takes an explicit mask: True means "may not attend" (future tokens).
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=inputs.device), diagonal=1)
    output = model(inputs, position_ids, causal.view(1, 1, t, t), labels=labels)  # (b, t) losses
    return output, partial(_loss, torch.ones_like(labels, dtype=torch.float32))


def lm_forward_backward(model: list, tokens: torch.Tensor, micro_batch_size: int,
                        forward_only: bool = False) -> float:
    """Forward (+backward) one global batch of this DP rank; returns the mean loss on all ranks.

    tokens: (B, T+1) int64, this data-parallel rank's share of the global batch.
    """
    num_micro = tokens.shape[0] // micro_batch_size
    if num_micro * micro_batch_size != tokens.shape[0]:
        raise ValueError(f"batch of {tokens.shape[0]} rows is not divisible by micro_batch_size={micro_batch_size}")
    micro = list(tokens.split(micro_batch_size))
    vpp = len(model)
    # Every model chunk pulls from its own iterator over the same micro-batches.
    iters = [iter(micro) for _ in range(vpp)] if vpp > 1 else iter(micro)
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
        total[0] = sum(float(d["lm loss"]) for d in losses)
        total[1] = len(losses)
    dist.all_reduce(total)  # sums over pipeline stages (non-last add 0), TP copies and DP
    return float(total[0] / total[1])



def _logits_step(data_iterator, model):
    tokens = next(data_iterator)  # (b, t)
    b, t = tokens.shape
    position_ids = torch.arange(t, device=tokens.device).unsqueeze(0).expand(b, t)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), diagonal=1)
    logits = model(tokens, position_ids, causal.view(1, 1, t, t))  # (b, t, vocab / tp)

    def keep(output):
        return output.sum() * 0.0, {"logits": output.detach().clone()}

    return logits, keep


@torch.no_grad()
def forward_logits(model: list, tokens: torch.Tensor, micro_batch_size: int = 1) -> torch.Tensor | None:
    """Full-vocabulary logits (B, T, padded vocab) on the last pipeline stage, None elsewhere.

    Gathers the TP-sharded vocabulary: for checks and exports only; the learner computes
    log-probs without gathering.
    """
    num_micro = tokens.shape[0] // micro_batch_size
    micro = list(tokens.split(micro_batch_size))
    vpp = len(model)
    outputs = get_forward_backward_func()(
        forward_step_func=_logits_step,
        data_iterator=[iter(micro) for _ in range(vpp)] if vpp > 1 else iter(micro),
        model=model if vpp > 1 else model[0],
        num_microbatches=num_micro, seq_length=tokens.shape[1], micro_batch_size=micro_batch_size,
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
