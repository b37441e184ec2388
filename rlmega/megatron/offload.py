"""What Megatron holds that can be offloaded: its parameter, gradient and optimizer tensors.

Megatron DDP keeps parameters and gradients in a few large contiguous buffers that every
parameter (and ``param.main_grad``) is a view of; the collectors below name those tensors and
rlmega/learner/offload.py (shared by both backends) moves their storages to host memory and back.
``offload_tensors`` / ``onload_tensors`` are re-exported here for existing callers.
"""

from __future__ import annotations

import torch

from rlmega.learner.offload import Saved, _distinct_storages, offload_tensors, onload_tensors  # noqa: F401  (re-exported)


def model_params(model: list) -> list[torch.Tensor]:
    return [p.data for chunk in model for p in chunk.parameters()]


def model_grads(model: list) -> list[torch.Tensor]:
    """Megatron DDP's gradient buffers (``param.main_grad`` views)."""
    return [
        p.main_grad
        for chunk in model
        for p in chunk.parameters()
        if getattr(p, "main_grad", None) is not None
    ]


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The plain torch optimizers inside Megatron's (possibly chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def optimizer_state(optimizer) -> list[torch.Tensor]:
    """Adam moments (and step counters) of every parameter shard this rank owns."""
    return [
        v
        for opt in torch_optimizers(optimizer)
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    ]


# Where Megatron's mixed-precision optimizers keep the fp32 master copies: the distributed optimizer
# this rank's shards, the plain one (use_distributed_optimizer=false) a full copy of each parameter.
_MAIN_PARAM_GROUPS = ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")


def main_params(optimizer) -> list[torch.Tensor]:
    """fp32 master copies kept for bf16 training, with or without the distributed optimizer. fp32
    models have none: their master weights are the parameters themselves (offload those with the params)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [
        p
        for o in inner
        for attr in _MAIN_PARAM_GROUPS
        for group in getattr(o, attr, [])
        for p in group
    ]
