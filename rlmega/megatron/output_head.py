"""The policy's output layer a chunk of tokens at a time (``actor.logprob_chunk_tokens``, issue 40).

megatron-core's GPTModel ends with ``self.output_layer(hidden_states, weight=...)``: a vocab-parallel
ColumnParallelLinear over every token of the micro-batch. While ``hidden_out`` is open the layer passes
its input through, so the model hands back its last hidden states (after the final norm) where the
logits would be; ``logprobs`` then calls the same layer on a chunk of scored positions at a time
(rlmega/algorithms/chunked_logprobs.py). Calling the real layer keeps what it does around the matmul:
the tensor-parallel all-reduce of the input's gradient, the tied embedding weight on the last stage,
Megatron DDP's gradient hooks.

Under sequence parallelism the hidden states leave the model split along the sequence (each TP rank
S/TP tokens). ``full_sequence`` gathers them first (its backward keeps each rank's part of the gradient,
no sum), and each chunk goes through the layer with its sequence-parallel flag off: its input's
gradient is then all-reduced over TP, the one sum the vocabulary split needs (the layer itself would
otherwise all-gather every chunk and reduce-scatter its gradient, with no gather of ours to pair with).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from rlmega.algorithms.chunked_logprobs import chunked_logprobs, scored_positions
from rlmega.megatron.hf_io import unwrap
from rlmega.megatron.vocab_parallel import entropy, token_logprobs


@contextmanager
def hidden_out(chunk):
    """While open, the last stage's ``chunk(...)`` returns hidden states (B, S, H) instead of logits."""
    layer = unwrap(chunk).output_layer
    layer.forward = lambda hidden, weight=None, runtime_gather_output=None: (hidden, None)
    try:
        yield
    finally:
        del layer.forward  # back to ColumnParallelLinear.forward


def full_sequence(chunk, hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's hidden states (B, S, H), whole along the sequence (gathered under sequence parallelism
    from each TP rank's (B, S/TP, H))."""
    if not unwrap(chunk).output_layer.sequence_parallel:
        return hidden
    return gather_from_sequence_parallel_region(
        hidden.transpose(0, 1), tensor_parallel_output_grad=False
    ).transpose(0, 1)


def logprobs(
    chunk,
    hidden: torch.Tensor,
    mb: dict,
    vocab_size: int,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (T,), entropy (T,) or None) at the micro-batch's response positions (0 elsewhere).

    hidden: (T, H) from the last stage under ``hidden_out`` (Float16Module hands it back in float32; the
    layer gets it in its weight's dtype, as it would have: the cast back is exact)."""
    model = unwrap(chunk)
    layer = model.output_layer
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None
    )
    dtype = (weight if weight is not None else layer.weight).dtype

    # (C, H) -> (C, V/tp); also when recomputed in the backward
    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        # h is whole: see above
        sequence_parallel, layer.sequence_parallel = layer.sequence_parallel, False
        try:
            # squeeze, not [:, 0]: a select's backward fills a zero (C, 1, V/tp) tensor first (~10% of a
            # train pass at 2k tokens over 152k tokens); a squeeze's is a view
            return layer(h.to(dtype).unsqueeze(1), weight=weight)[0].squeeze(1)
        finally:
            layer.sequence_parallel = sequence_parallel

    return chunked_logprobs(
        hidden,
        mb["labels"].to(hidden.device),
        scored_positions(mb["response_positions"], hidden.device),
        chunk_tokens,
        logits_fn,
        lambda z, y: token_logprobs(z, y, vocab_size, temperature),
        (lambda z: entropy(z, vocab_size, temperature)) if with_entropy else None,
        entropy_grad,
    )
