"""The critic's config checks as functions (issue 25): what rlmega/config/validate.py and rlmega/preflight.py add for
algorithm.advantage_estimator=gae, on configs built in Python. The refusals as a user meets them (both
`rlmega train` and `check-config`) are rows of tests/unit/test_bad_inputs.py."""

import json

import pytest

from rlmega.agents.placement import run_cpus
from rlmega.config.errors import ConfigError
from rlmega.config.schema import ParallelismConfig, RLConfig
from rlmega.config.validate import critic_ranks, read_model_shape, validate


def _gae(**critic) -> RLConfig:
    cfg = RLConfig()
    cfg.algorithm.advantage_estimator = "gae"
    for k, v in critic.items():
        setattr(cfg.critic, k, v)
    return cfg


def test_run_cpus_count_the_critic_ranks_only_with_gae():
    grpo = RLConfig()
    grpo.parallelism.world_size = 4
    base = run_cpus(grpo)
    gae = _gae()
    gae.parallelism.world_size = 4
    # null critic.parallelism: the actor's layout
    assert critic_ranks(grpo) == 0 and critic_ranks(gae) == 4
    assert run_cpus(gae) == pytest.approx(base + 4 * gae.cluster.actor_cpus_per_rank)
    gae.critic.parallelism = ParallelismConfig(world_size=2)
    gae.cluster.actor_cpus_per_rank = 1.5
    grpo.cluster.actor_cpus_per_rank = 1.5
    assert run_cpus(gae) == pytest.approx(run_cpus(grpo) + 2 * 1.5)


def test_default_gae_config_is_valid_with_one_sample_per_prompt():
    cfg = _gae()
    cfg.rollout.n, cfg.trainer.global_batch_size = 1, 2
    validate(cfg)


def test_python_built_critic_choices_and_ranges_are_checked():
    """_choice_problems reaches sections inside sections (OmegaConf checks them only on load)."""
    cfg = _gae(warmup_steps=2, parallelism=ParallelismConfig(world_size=0))
    cfg.critic.optimizer.lr_decay_style = "step"
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    fields = [p.split(":")[0] for p in e.value.problems]
    assert fields == ["critic.optimizer.lr_decay_style", "critic.parallelism.world_size"], (
        e.value.problems
    )


def test_warm_up_is_refused_without_gae_and_past_the_run_with_it():
    cfg = RLConfig()
    cfg.critic.warmup_steps = 1
    with pytest.raises(
        ConfigError, match="critic.warmup_steps: 1, but algorithm.advantage_estimator=grpo"
    ):
        validate(cfg)
    cfg = _gae(warmup_steps=1)
    validate(cfg)  # total_steps 2: one step of critic warm-up, then the policy trains
    cfg.critic.warmup_steps = 2
    with pytest.raises(ConfigError, match="warm-up longer than the run"):
        validate(cfg)


def test_read_model_shape_names_the_field_it_reads(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 0, "num_hidden_layers": 2, "hidden_size": 8})
    )
    with pytest.raises(ConfigError) as e:
        read_model_shape(str(tmp_path), "critic.path")
    assert (
        e.value.problems[0].startswith("critic.path: ")
        and "num_attention_heads=0" in e.value.problems[0]
    )
