"""RMSNorm for megatron-core's local layer spec (no Transformer Engine, no Apex) under sequence parallelism.

megatron-core 0.16's ``WrappedTorchNorm`` (the local spec's norm) refuses ``sequence_parallel``: under it a
norm sees only its TP rank's part of the tokens, so its weight's gradient is partial, and megatron-core sums
such gradients over the TP ranks only for parameters marked ``sequence_parallel`` (finalize_model_grads), a
mark TE's and Apex's norms set and torch's does not. ``TokenRMSNorm`` is torch's RMSNorm with the mark (the
layers' input / pre-MLP norms and the final norm); ``HeadRMSNorm``, for Qwen3's q/k norms, sees every token
of its heads under either layout and is not marked (megatron-core sums the q/k norms' gradients over TP by
name already). Both compute exactly what WrappedTorchNorm's torch.nn.RMSNorm computes; their ``ZeroCentered``
forms compute Gemma's (1 + weight) norm in float32 (rlmega/megatron/gemma3.py).
"""

from __future__ import annotations

import torch


class TokenRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"TokenRMSNorm is an RMSNorm; the config asks for {config.normalization}"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)


def _zero_centered_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, as transformers' Gemma3RMSNorm computes it: in float32, scaled by (1 + weight), then cast
    back (the weight is stored centred on 0: megatron-core's ``layernorm_zero_centered_gamma``)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


class ZeroCenteredTokenRMSNorm(TokenRMSNorm):
    """``TokenRMSNorm`` (the sequence-parallel mark) computing Gemma's (1 + weight) norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _zero_centered_rms(x, self.weight, self.eps)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        """Its weight replicated over TP and DP, as megatron-core's default for a torch module: inside megatron-core's
        MLP (Gemma 3's post-MLP norm, rlmega/megatron/gemma3.py) every child must have this method."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        # both groups: with one alone every TP rank reads as 0
        tp = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},
            sharded_offsets,
            tp_group=tp,
            dp_cp_group=metadata["dp_cp_group"],
        )


class ZeroCenteredHeadRMSNorm(HeadRMSNorm):
    """``HeadRMSNorm`` (Gemma 3's q/k norms over each head) computing Gemma's (1 + weight) norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _zero_centered_rms(x, self.weight, self.eps)
