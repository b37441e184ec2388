"""The learning-rate schedule both training backends follow: Megatron's OptimizerParamScheduler.

    lr_at(step, lr=1e-5, min_lr=0.0, warmup_steps=10, decay_steps=100, style="cosine")

``step`` counts optimizer steps taken. Linear warm-up from 0 to ``lr`` over ``warmup_steps`` (step
0 gets 0, step ``warmup_steps`` gets ``lr``), then ``style``: constant (``lr`` for ever), or a linear
or cosine decay reaching ``min_lr`` at ``decay_steps`` and staying there. ``decay_steps`` counts
from step 0 (warm-up included); it is at least ``warmup_steps + 1``, as the Megatron manager sets it.
Megatron's formula exactly (tests/unit/test_lr_schedule.py compares them step by step), so an FSDP
run and a Megatron run of the same config use the same LR at every step. Pure Python, no torch.
"""

from __future__ import annotations

import math

STYLES = ("constant", "cosine", "linear")


def decay_steps_for(lr_decay_steps: int, warmup_steps: int) -> int:
    """The decay length both managers use: the caller's, but past the warm-up."""
    return max(lr_decay_steps, warmup_steps + 1)


def lr_at(
    step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int, style: str
) -> float:
    """The learning rate after ``step`` optimizer steps (see the module docstring)."""
    if style not in STYLES:
        raise ValueError(f"optimizer.lr_decay_style={style!r}: choose one of {', '.join(STYLES)}")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * float(step) / float(warmup_steps)  # Megatron's init_lr is 0 with a warm-up
    if style == "constant":
        return lr
    if step > decay_steps:
        return min_lr
    ratio = float(step - warmup_steps) / float(decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


class LRSchedule:
    """Sets ``optimizer``'s param groups' lr from ``lr_at`` (the Megatron scheduler's interface).

    ``step(increment)`` advances the count by ``increment`` (0 re-applies the current LR) and writes
    it into every param group. ``state_dict()`` holds only the step count: on resume the config's
    settings win over the checkpoint's, as for Megatron (use_checkpoint_opt_param_scheduler=False).
    """

    def __init__(
        self, optimizer, lr: float, min_lr: float, warmup_steps: int, decay_steps: int, style: str
    ):
        self.optimizer = optimizer
        self.lr, self.min_lr, self.style = lr, min_lr, style
        self.warmup_steps, self.decay_steps = (
            warmup_steps,
            decay_steps_for(decay_steps, warmup_steps),
        )
        self.num_steps = 0
        # a bad style fails here, not mid-run
        lr_at(0, lr, min_lr, warmup_steps, self.decay_steps, style)
        self.step(0)

    def get_lr(self) -> float:
        return lr_at(
            self.num_steps, self.lr, self.min_lr, self.warmup_steps, self.decay_steps, self.style
        )

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self.step(0)
