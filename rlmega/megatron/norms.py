"""RMSNorm for megatron-core's local layer spec (no Transformer Engine, no Apex) under sequence parallelism.

megatron-core 0.16's ``WrappedTorchNorm`` (the local spec's norm) refuses ``sequence_parallel``: under it a
norm sees only its TP rank's part of the tokens, so its weight's gradient is partial, and megatron-core sums
such gradients over the TP ranks only for parameters marked ``sequence_parallel`` (finalize_model_grads), a
mark TE's and Apex's norms set and torch's does not. ``TokenRMSNorm`` is torch's RMSNorm with the mark (the
layers' input / pre-MLP norms and the final norm); ``HeadRMSNorm``, for Qwen3's q/k norms, sees every token
of its heads under either layout and is not marked (megatron-core sums the q/k norms' gradients over TP by
name already). Both compute exactly what WrappedTorchNorm's torch.nn.RMSNorm computes.
"""
from __future__ import annotations

import torch


class TokenRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"TokenRMSNorm is an RMSNorm; the config asks for {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)
