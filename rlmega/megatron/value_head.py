"""A critic's output layer on Megatron: hidden -> 1, in the place of GPTModel's output layer.

GPTModel calls ``self.output_layer(hidden (S, B, H), weight=None, runtime_gather_output=...)`` and
expects ``(logits, bias)``; this module answers with (values (S, B, 1), None). Its weight is whole on
every tensor-parallel rank (HF ``score.weight``, "replicated" in rlmega/megatron/hf_weights.py): without
sequence parallelism every TP rank holds the same final-norm hidden state, so each computes the same
values and the same head gradient, and the gradient into the hidden state is already the full one
(the vocabulary head's ColumnParallelLinear all-reduces partial ones instead). Megatron DDP reduces its
gradient over data-parallel ranks like any parameter; dist checkpointing stores it as a replicated tensor.
"""
from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """(S, B, H) -> ((S, B, 1), None), as ColumnParallelLinear returns (output, bias)."""
        return torch.matmul(hidden_states, self.weight.t()), None
