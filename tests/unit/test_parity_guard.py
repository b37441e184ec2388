"""The parity guard's pure parts: which samples it measures, its verdicts, its limits and messages."""

import logging
import math

import pytest
import torch

from rlmega.sync.parity import ParityGuard, on_policy_diff, parity_limits, parity_verdict


def test_only_samples_of_the_current_weights_are_measured():
    rollout = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -5.0]), torch.tensor([-3.0])]
    actor = [torch.tensor([-1.0, -2.5]), torch.tensor([-1.0, -1.0]), torch.tensor([-3.25])]
    masks = [torch.ones(2), torch.ones(2), torch.ones(1)]
    # sample 1 is stale: its 4.0 is ignored
    got = on_policy_diff(rollout, actor, masks, [True, False, True])
    assert got == {"max": 0.5, "mean": (0 + 0.5 + 0.25) / 3, "samples": 2}
    assert on_policy_diff(rollout, actor, masks, [False] * 3) == {
        "max": 0.0,
        "mean": 0.0,
        "samples": 0,
    }


def test_verdicts_and_nan():
    assert [parity_verdict(x, 1e-3, 1e-2) for x in (1e-6, 1e-3, 2e-3, 1e-2, 0.5)] == [
        "ok",
        "ok",
        "warn",
        "warn",
        "stop",
    ]
    assert parity_verdict(math.nan, 1e-3, 1e-2) == "stop"


def test_limits_default_by_dtype_and_configured_values_win():
    assert parity_limits("float32", None, None) == (1e-3, 1e-2)
    assert parity_limits("float32", 5e-4, 1.0) == (5e-4, 1.0)


def _metrics(value, samples=8):
    return {"step": 3, "parity_max": value, "parity_samples": samples, "logprob_diff_mean": 1e-7}


def test_guard_warns_then_stops_with_the_numbers(caplog):
    guard = ParityGuard("float32", None, None)
    with caplog.at_level(logging.WARNING):
        assert guard(_metrics(2e-6)) is None and not caplog.records
        assert guard(_metrics(4e-3)) is None
    assert (
        "step 3" in caplog.text
        and "0.004" in caplog.text
        and "rollout.parity_warn=0.001" in caplog.text
    )
    reason = guard(_metrics(0.03))
    assert "0.03" in reason and "rollout.parity_stop=0.01" in reason and "8 samples" in reason


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=20)])
def test_guard_is_off_when_the_engine_renormalises(kw):
    assert ParityGuard("float32", None, None, **kw)(_metrics(5.0)) is None


def test_guard_has_nothing_to_say_without_fresh_samples():
    assert ParityGuard("float32", None, None)(_metrics(5.0, samples=0)) is None


def test_bf16_has_measured_defaults_and_a_lone_limit_keeps_the_other_default(caplog):
    """bf16's limits come from a GPU run (0.057..0.102 a step); a stop set alone keeps the default warn."""
    assert parity_limits("bfloat16", None, None) == (2.0, 10.0)
    guard = ParityGuard("bfloat16", None, 0.5)
    assert not guard.off and guard(_metrics(0.102)) is None  # the largest bf16 step measured passes
    with caplog.at_level(logging.WARNING):
        assert ParityGuard("bfloat16", None, None)(_metrics(3.0)) is None
    assert "above rollout.parity_warn=2" in caplog.text
    assert "rollout.parity_stop=0.5" in guard(_metrics(0.7))
