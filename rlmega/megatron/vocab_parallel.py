"""Log-probs and entropy over a vocabulary split across tensor-parallel ranks, never gathered.

Each TP rank holds logits for a contiguous slice [r*V/tp, (r+1)*V/tp) of the padded vocabulary.
Softmax statistics are combined with all-reduces inside the TP group (max, sum of exp), so the
full (tokens x vocab) logits never exist on one rank. Columns past the real vocabulary (padding
added so TP divides it) are masked to -inf first: they are not tokens and must carry no
probability, or log-probs would differ from the Hugging Face model and from vLLM.

Both functions are differentiable: every TP rank computes the same value, and the backward of
the all-reduced sums is the identity, which gives each rank the gradient of its own slice (the
same scheme as Megatron's vocab-parallel cross-entropy, which ``token_logprobs`` reuses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _mask_padding(
    logits: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits with padded-vocab columns at -inf, the boolean pad mask of this slice or None)."""
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits, None
    pad = torch.arange(start, start + local, device=logits.device) >= vocab_size  # (V/tp,)
    return logits.masked_fill(pad, float("-inf")), pad


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature).

    logits: (..., V/tp) this rank's vocabulary slice; targets: (...) int64 global token ids.
    Returns (...) float32.
    """
    # a fresh tensor: Megatron's kernel edits its input in place
    scaled = logits.float() / temperature
    scaled, _ = _mask_padding(scaled, vocab_size)
    return -vocab_parallel_cross_entropy(scaled, targets)


def entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the real vocabulary. (..., V/tp) -> (...)."""
    z = logits.float() / temperature
    z, pad = _mask_padding(z, vocab_size)
    m = z.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = z - m  # a constant shift: no gradient needed through it
    e = z.exp()  # 0 on padding
    ez = e * (z if pad is None else z.masked_fill(pad, 0.0))  # avoid 0 * -inf
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(-1))
    sum_ez = reduce_from_tensor_model_parallel_region(ez.sum(-1))
    return sum_e.log() - sum_ez / sum_e  # H = log Z - E[z]
