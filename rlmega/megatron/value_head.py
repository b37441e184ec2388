"""A critic's output layer on Megatron: hidden -> 1, in the place of GPTModel's output layer.

GPTModel calls ``self.output_layer(hidden (S, B, H), weight=None, runtime_gather_output=...)`` and
expects ``(logits, bias)``; this module answers with (values (S, B, 1), None). Its weight is whole on
every tensor-parallel rank (HF ``score.weight``, "replicated" in rlmega/megatron/hf_weights.py): without
sequence parallelism every TP rank holds the same final-norm hidden state, so each computes the same
values and the same head gradient, and the gradient into the hidden state is already the full one
(the vocabulary head's ColumnParallelLinear all-reduces partial ones instead). Megatron DDP reduces its
gradient over data-parallel ranks like any parameter; dist checkpointing stores it as a replicated tensor.

Under sequence parallelism each TP rank holds S/TP of the tokens: it computes their values, which are
then gathered along the sequence (backward: each rank keeps its part of the gradient, no sum: every TP
rank computes the same loss over all values), and the weight's gradient from its own tokens is summed
over the TP ranks by megatron-core's finalize_model_grads, as for the norms (``sequence_parallel``
marks the parameter).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    def __init__(
        self, hidden_size: int, dtype: torch.dtype, device=None, sequence_parallel: bool = False
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """(S or S/TP, B, H) -> ((S, B, 1), None), as ColumnParallelLinear returns (output, bias)."""
        values = torch.matmul(hidden_states, self.weight.t())
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
