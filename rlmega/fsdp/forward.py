"""Packed micro-batch -> logits, token log-probs and entropy through a Hugging Face causal LM.

A micro-batch is ``rlmega.data.micro_batches.build_micro_batch(batch, indices)``:
ONE row of several sequences, ``tokens`` and ``position_ids`` (1, T) with positions restarting at 0
per sequence, and flat per-token fields (T,) on the same positions as the logits.

Attention over a packed row: the row goes in with ``attention_mask=None`` and no cache, and the
model's attention (``rlmega.fsdp.packed_attention``, set by FSDPModelManager) reads the sequence
boundaries from the position ids (every place where a position is not the previous one + 1 starts a
sequence) and runs causal sdpa on each sequence alone (flash-attention kernels take the same position
ids as varlen boundaries). RoPE uses each token's own position, as vLLM does. So packing changes no
log-prob (tests/multiproc/test_fsdp_actor.py measures it). A sequence must therefore start at
position 0 and count up by one, which ``packing.pack`` guarantees.

Numerics match rlmega/megatron/vocab_parallel.py: logits.float() / temperature, log-softmax, in
float32 whatever the model's dtype; the HF head has exactly ``config.vocab_size`` columns (no TP
padding to mask).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rlmega.algorithms.chunked_logprobs import chunked_logprobs, scored_positions
from rlmega.fsdp.vision_inputs import MROPE_TYPES, row_vision_kwargs, sampled_placeholders_as_text


def forward_logits(model, mb: dict) -> torch.Tensor:
    """Logits (T, V) of a one-row packed micro-batch, in the model's dtype, on its device."""
    tokens = mb["tokens"]
    if tokens.shape[0] != 1:
        raise ValueError(
            f"FSDP micro-batches are one packed row (build_micro_batch(...)); "
            f"got {tokens.shape[0]} rows"
        )
    device = next(model.parameters()).device
    # a VLM's images (mb["vision"]: each sequence's processor outputs, None for text) and mRoPE positions
    kwargs = row_vision_kwargs(
        model.config,
        tokens,
        mb["position_ids"],
        mb.get("vision") or [],
        _rope_index(model),
        mb.get("prompt_ends"),
    )
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    with sampled_placeholders_as_text(model, tokens.to(device), kwargs["input_ids"]):
        out = model(attention_mask=None, use_cache=False, **kwargs)
    # not [0]: a select's backward fills a zero copy of the whole logits first
    return out.logits.squeeze(0)


def _rope_index(model):
    """The mRoPE model's get_rope_index (Qwen2-VL: on its inner model, under any wrapper), else None."""
    if getattr(model.config, "model_type", None) not in MROPE_TYPES:
        return None
    return next(m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index"))


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), float32. logits (T, V), targets (T,) int64 -> (T,)."""
    z = logits.float() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature), float32: H = logsumexp(z) - E_p[z]. (T, V) -> (T,)."""
    z = logits.float() / temperature
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


@contextmanager
def hidden_out(model):
    """While open, ``model(...)`` hands back its last hidden states (after the final norm) where its
    logits would be: the output layer passes its input through (the logits are then computed a chunk at
    a time, rlmega/algorithms/chunked_logprobs.py). The call still goes through the FSDP root, so the
    head's weight is gathered as usual and its gradient reduced with the rest."""
    head = model.get_output_embeddings()
    head.forward = lambda hidden: hidden
    try:
        yield head
    finally:
        del head.forward  # back to the class's forward


def check_chunkable(config) -> None:
    """Refuse a model whose logits are not ``lm_head(hidden)``: chunked log-probs would skip the rest."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"{type(config).__name__} caps its logits (final_logit_softcapping={cap}) after the output "
            "layer, which chunked log-probs do not apply; fix: set actor.logprob_chunk_tokens: 0"
        )


def micro_batch_logprobs(
    model,
    mb: dict,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (T,), entropy (T,) or None) of one packed micro-batch at its ``labels``.

    Differentiable in the log-probs when grad is enabled; ``entropy_grad`` False computes the entropy
    without a graph (a metric only: its softmax over the vocabulary is not kept for the backward).
    ``chunk`` > 0: only the response positions are scored (0 elsewhere), ``chunk`` at a time, without the
    whole logits (rlmega/algorithms/chunked_logprobs.py); 0: every position, from the whole logits.
    """
    if chunk > 0:
        with hidden_out(model) as head:
            hidden = forward_logits(model, mb)
        weight = head.weight
        return chunked_logprobs(
            hidden,
            mb["labels"].to(hidden.device),
            scored_positions(mb["response_positions"], hidden.device),
            chunk,
            logits_fn=lambda h: torch.nn.functional.linear(h.to(weight.dtype), weight, head.bias),
            logprob_fn=lambda z, y: token_logprobs(z, y, temperature),
            entropy_fn=(lambda z: entropy(z, temperature)) if with_entropy else None,
            entropy_grad=entropy_grad,
        )
    logits = forward_logits(model, mb)
    lp = token_logprobs(logits, mb["labels"].to(logits.device), temperature)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy(logits, temperature)
    return lp, ent
