"""On-policy distillation's per-token signal: the reverse KL between the student and its teachers, estimated
on the tokens the student sampled.

For a sampled token y_t the estimate is k1 = log pi_student(y_t) - log pi_teacher(y_t): its expectation under
the student is KL(student || teacher), the reverse KL, which OPD minimises. The token's advantage is its
negative, teacher minus student: a token the teacher finds likelier than the student did is reinforced.
Each teacher's term is weighted (distillation.teachers[i].weight) and the sum scaled by a coefficient
(distillation.coef); a sample no teacher scores (its task has none) gets 0.

The student's log-probs are the behaviour policy's as the trainer recomputes them (old_logprobs), at the
sampling temperature, and so are the teachers' (each teacher's pass uses the same temperature): the signal
is fixed before the update, as a reward is.

Pure functions: tensors and scalars in, tensors out; no config objects, no process groups.
"""

from __future__ import annotations

from typing import Sequence

import torch


def token_signal(
    student: list[torch.Tensor],
    teachers: Sequence[tuple[float, Sequence[torch.Tensor | None]]],
    coef: float = 1.0,
) -> list[torch.Tensor]:
    """coef * sum_i weight_i * (teacher_i - student), per token, for each sample.

    student: per sample (R_s,) log-probs of its response tokens; teachers: (weight_i, per sample (R_s,)
    log-probs or None where teacher i does not score that sample) -> per sample (R_s,) float32, 0 where
    no teacher scores it. Computed in float64, rounded once.
    """
    out = []
    for s, lp in enumerate(student):
        total = torch.zeros(lp.shape, dtype=torch.float64)
        for weight, per_sample in teachers:
            t = per_sample[s]
            if t is not None:
                if t.shape != lp.shape:
                    raise ValueError(
                        f"sample {s}: teacher log-probs {tuple(t.shape)} for {tuple(lp.shape)} student tokens"
                    )
                total += weight * (t.double() - lp.double())
        out.append((coef * total).float())
    return out


def reverse_kl(
    student: list[torch.Tensor], teacher: Sequence[torch.Tensor | None], masks: list[torch.Tensor]
) -> float:
    """The k1 estimate of KL(student || teacher): the mean over the scored samples' masked tokens of
    student - teacher (nan when the teacher scores no token).

    student, teacher: per sample (R_s,) log-probs (teacher None: not scored); masks: per sample (R_s,) float.
    """
    num = den = 0.0
    for lp, t, m in zip(student, teacher, masks):
        if t is not None:
            num += float(((lp.double() - t.double()) * m.double()).sum())
            den += float(m.sum())
    return num / den if den else float("nan")
