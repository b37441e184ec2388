"""Asynchronous production trains on samples of older policies: unless told otherwise, the rollout
correction is on (TIS) in async mode and off in sync mode (issue 22 item 15; README, Asynchronous RL)."""

from rlmega.config.load import dump_config, load_config
from rlmega.config.schema import AlgorithmConfig


def test_async_defaults_to_tis_and_an_explicit_choice_wins():
    assert load_config(None, []).algorithm.rollout_correction == "none"
    async_cfg = load_config(None, ["produce.strategy=async"])
    # before: "none", stale samples uncorrected
    assert async_cfg.algorithm.rollout_correction == "tis"
    assert "rollout_correction: tis" in dump_config(async_cfg)  # config.yaml records what ran
    for choice in ("none", "mis_token"):
        cfg = load_config(
            None, ["produce.strategy=async", f"algorithm.rollout_correction={choice}"]
        )
        assert cfg.algorithm.rollout_correction == choice
    # a section built in code (tests, tools) without the loader: off, as before
    assert AlgorithmConfig().resolve_defaults().rollout_correction == "none"
