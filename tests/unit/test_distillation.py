"""On-policy distillation's arithmetic (rlmega/algorithms/opd.py) and how the driver composes it with the
reward estimators (rlmega.step.with_advantages), by hand. The refusals at load are rows of
tests/unit/test_bad_inputs.py; the teachers' log-probs on both learners are tests/multiproc/test_teachers.py's."""

import math

import pytest
import torch

from rlmega.algorithms import advantages as adv_lib
from rlmega.algorithms import opd
from rlmega.config.schema import AlgorithmConfig
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.step import StepPlan, with_advantages


def test_the_signal_is_the_weighted_teacher_minus_student_per_token_and_0_where_no_teacher_scores():
    student = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    t1 = [torch.tensor([-1.5, -1.0]), None]  # teaches sample 0 only
    t2 = [torch.tensor([-1.0, -4.0]), torch.tensor([-0.25])]
    got = opd.token_signal(student, [(1.0, t1), (0.5, t2)], coef=2.0)
    # sample 0: 2 * (1.0 * (-0.5, 1.0) + 0.5 * (0.0, -2.0)) = (-1, 0); sample 1: 2 * 0.5 * 0.25
    assert torch.equal(got[0], torch.tensor([-1.0, 0.0])) and torch.equal(
        got[1], torch.tensor([0.25])
    )
    alone = opd.token_signal(student, [(1.0, [None, None])])
    assert all(torch.equal(x, torch.zeros_like(x)) for x in alone)
    with pytest.raises(ValueError, match="sample 1: teacher log-probs"):
        opd.token_signal(student, [(1.0, [student[0], torch.zeros(3)])])


def test_the_reverse_kl_estimate_is_the_mean_student_minus_teacher_over_loss_tokens():
    student = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.0])]
    teacher = [torch.tensor([-2.0, -2.0, -9.0]), None]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]  # the third token: tool output
    assert opd.reverse_kl(student, teacher, masks) == pytest.approx(0.5)  # (1 + 0) / 2
    assert math.isnan(opd.reverse_kl(student, [None, None], masks))


def _batch(rewards, group_ids, old):
    n = len(rewards)
    return RolloutBatch(
        tokens=[torch.arange(1 + len(o)) for o in old],
        prompt_lens=torch.ones(n, dtype=torch.int64),
        response_mask=[torch.ones(len(o)) for o in old],
        group_ids=torch.tensor(group_ids),
        sample_ids=torch.arange(n),
        rewards=torch.tensor(rewards),
        old_logprobs=old,
    )


PLAN = StepPlan(
    n_mini=1, kl_reward=False, gae=False, policy_trains=True, on_policy=False, distill=True
)


def test_opd_alone_is_the_signal_and_a_reward_estimator_adds_it():
    old = [torch.tensor([-1.0, -1.0]), torch.tensor([-2.0]), torch.tensor([-0.5, -0.5])]
    teacher = [torch.tensor([-0.5, -3.0]), torch.tensor([-2.0]), torch.tensor([-1.0, 0.0])]
    batch = _batch([1.0, 0.0, 1.0], [0, 0, 1], old)
    taught = [(1.0, teacher)]
    signal = [t - s for t, s in zip(teacher, old)]
    alone = with_advantages(
        batch, PLAN, AlgorithmConfig(advantage_estimator="opd"), taught, coef=1.0
    )
    assert all(torch.allclose(a, b) for a, b in zip(alone.advantages, signal))
    mixed = with_advantages(
        batch, PLAN, AlgorithmConfig(advantage_estimator="rloo"), taught, coef=0.5
    )
    seq = adv_lib.compute("rloo", batch.rewards, batch.group_ids)
    want = [float(a) + 0.5 * s for a, s in zip(seq, signal)]
    assert all(torch.allclose(a, b) for a, b in zip(mixed.advantages, want))
    # no teacher: the estimator's advantages as before
    plain = with_advantages(batch, PLAN, AlgorithmConfig(advantage_estimator="rloo"))
    assert [a.tolist() for a in plain.advantages] == [
        [float(seq[0])] * 2,
        [float(seq[1])],
        [0.0] * 2,
    ]
