"""Causal attention within a sliding window, for one sequence, without a (t, t) mask.

    out = windowed_causal_attention(q, k, v, window=512, scale=0.0625)   # q (B, H, t, D) -> (B, H, t, D)

Query ``i`` attends keys ``j`` with ``0 <= i - j < window`` (the window counts the token itself: transformers'
``sliding_window`` and vLLM's; megatron-core's ``window_size`` is ``(window - 1, 0)``). The queries go in blocks of
``window``: a block attends the keys from ``window - 1`` before its first query to its last, under a (window,
2 * window) mask, so memory is O(t * window), not the O(t^2) of one dense mask over a 32k-token sequence.
A sequence no longer than the window is plain causal attention (no mask: the flash kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def windowed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float,
    dropout: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """q (B, H, t, D), k/v (B, H_kv, t, D) -> (B, H, t, D): each query over the last ``window`` keys up to itself."""
    t = q.shape[2]
    if window < 1:
        raise ValueError(f"windowed_causal_attention: window={window} must be >= 1")
    if t <= window:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    outs = []
    for start in range(0, t, window):
        end, first_key = min(start + window, t), max(0, start - window + 1)
        i = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(first_key, end, device=q.device)[None, :]
        allowed = (j <= i) & (i - j < window)  # (queries, keys), True = attend
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, first_key:end],
                v[:, :, first_key:end],
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(outs, dim=2)
