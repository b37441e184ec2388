"""The FSDP backend's LR schedule equals Megatron's OptimizerParamScheduler at every step."""

import pytest
import torch

from rlmega.algorithms.lr_schedule import LRSchedule

STEPS = 300


@pytest.mark.parametrize("style", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_schedule_equals_megatrons(style, warmup):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # decay < STEPS: the tail past the decay (min_lr) is compared too
    lr, min_lr, decay = 3e-4, 2e-5, 200
    ours_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    theirs_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ours = LRSchedule(ours_opt, lr, min_lr, warmup, decay, style)
    # configured as rlmega/megatron/model_manager.py configures it
    theirs = OptimizerParamScheduler(
        theirs_opt,
        init_lr=0.0 if warmup else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    seen = set()
    for _ in range(STEPS):
        a, b = ours_opt.param_groups[0]["lr"], theirs_opt.param_groups[0]["lr"]
        assert a == b, (ours.num_steps, a, b)  # the same formula: bit-equal, no tolerance
        seen.add(a)
        ours.step(1)
        theirs.step(increment=1)
    # the schedule did move (constant: only through its warm-up)
    assert len(seen) == {"constant": warmup + 1}.get(style, len(seen)) and (
        style == "constant" or len(seen) > 100
    )


def test_state_holds_only_the_step_and_a_bad_style_is_named():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    s = LRSchedule(opt, 1e-3, 0.0, 10, 100, "cosine")
    s.step(5)
    t = LRSchedule(opt, 2e-3, 0.0, 10, 100, "cosine")  # a resume with a new lr: the config wins
    t.load_state_dict(s.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # 5/10 of the new 2e-3
    with pytest.raises(ValueError, match="optimizer.lr_decay_style"):
        LRSchedule(opt, 1e-3, 0.0, 0, 10, "wsd")
