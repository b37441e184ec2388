"""Token log-probs and entropy from the last hidden states, a chunk of tokens at a time: the whole
(tokens x vocabulary) logits never exist (issue 40).

Today's head computes logits for every token of a micro-batch and then several float32 copies of them
(the scaled logits, the masked logits, the softmax the cross-entropy saves for its backward): at 16k tokens
over a 151,936-token vocabulary that is ~10 GB a copy. Here:

- logits are computed only at the positions whose log-prob is read (the prediction positions of the
  response tokens; prompt positions are never scored);
- those positions are taken ``chunk`` at a time: the output layer, the log-softmax and the entropy of one
  chunk, then the next;
- in a pass that builds a graph, every chunk but the last is recomputed in the backward
  (``torch.utils.checkpoint``): its forward keeps only its input hidden states, as fused
  linear-cross-entropy kernels do. The last chunk keeps its graph, as today's head does (the backward
  starts with it at once, so recomputing it would cost a matmul and save no peak), so a micro-batch with
  at most ``chunk`` scored tokens costs no recomputation at all.

Peak memory then grows with ``chunk``, not with the micro-batch's tokens x vocabulary. The numbers are
today's: each token's log-prob and entropy are the same function of the same hidden state and weights
(chunking changes which rows share a matmul call, so float results may differ by rounding only).

The backend supplies three functions of one chunk; collectives inside them (tensor-parallel all-reduces)
are fine: every rank of the group runs the same chunks in the same order, forward and recompute alike.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# hidden (C, H) -> logits (C, V or V/tp)
Logits = Callable[[torch.Tensor], torch.Tensor]
# logits (C, V), labels (C,) -> (C,) float32
LogProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Entropy = Callable[[torch.Tensor], torch.Tensor]  # logits (C, V) -> (C,) float32


def scored_positions(response_positions: list[tuple[int, int]], device=None) -> torch.Tensor:
    """The prediction positions [a, b) of every response, concatenated: (N,) int64."""
    if not response_positions:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, b, device=device) for a, b in response_positions])


def _chunk_outputs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    logits_fn: Logits,
    logprob_fn: LogProbs,
    entropy_fn: Entropy | None,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (C,), entropy (C,) or an empty tensor) of one chunk of hidden states (C, H)."""
    logits = logits_fn(hidden)
    lp = logprob_fn(logits, labels)
    if entropy_fn is None:
        return lp, lp.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # a metric: no graph
        ent = entropy_fn(logits)
    return lp, ent


def chunked_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    chunk: int,
    logits_fn: Logits,
    logprob_fn: LogProbs,
    entropy_fn: Entropy | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token (log-probs (T,), entropy (T,) or None), float32, computed at ``positions`` only (0 elsewhere).

    hidden: (T, H) the model's last hidden states (after its final norm), one per token position;
    labels: (T,) int64 the token each position predicts; positions: (N,) int64 the positions scored;
    chunk: scored positions per output-layer call (> 0). Differentiable in the log-probs (and in the
    entropy with ``entropy_grad``) when grad is enabled.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0 (got {chunk})")
    T = hidden.shape[0]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    placeholder = positions.numel() == 0
    # nothing scored (a placeholder micro-batch): still run the head once, weighted 0, so
    if placeholder:
        # its weights get a (zero) gradient and every rank's backward reduces the same parameters (FSDP2)
        positions = torch.zeros(1, dtype=torch.int64, device=positions.device)
    lps, ents = [], []
    pieces = positions.split(chunk)
    for k, pos in enumerate(pieces):
        h, y = hidden.index_select(0, pos), labels.index_select(0, pos)
        # recomputed in the backward; the last chunk keeps its graph
        if grad and k < len(pieces) - 1:
            lp, ent = checkpoint(
                _chunk_outputs,
                h,
                y,
                logits_fn,
                logprob_fn,
                entropy_fn,
                entropy_grad,
                use_reentrant=False,
            )
        else:
            lp, ent = _chunk_outputs(h, y, logits_fn, logprob_fn, entropy_fn, entropy_grad)
        lps.append(lp)
        ents.append(ent)
    scale = 0.0 if placeholder else 1.0
    lp_all = hidden.new_zeros(T, dtype=torch.float32).index_put(
        (positions,), torch.cat(lps) * scale
    )
    if entropy_fn is None:
        return lp_all, None
    return lp_all, hidden.new_zeros(T, dtype=torch.float32).index_put(
        (positions,), torch.cat(ents) * scale
    )
