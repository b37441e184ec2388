"""Sections as the run uses them, resolved across the config: the one place, beside the rules, that reads the
whole RLConfig to hand each module the sections it takes.

    tasks = task_configs(cfg)          # cfg.tasks, or the one task "default" made of data + agent_loop
    critic = critic_kwargs(cfg)        # the critic's constructor arguments, its nulls taken from other sections
    ranks = trainer_ranks(cfg)         # the policy's ranks and the critic's
    models = teacher_models(cfg)       # a ModelConfig per distillation teacher
    ids = teacher_identities(cfg)      # what a checkpoint records of them (a resume may not change it)
"""

from __future__ import annotations

import dataclasses
import os

from rlmega.config.critic_rules import critic_ranks
from rlmega.config.schema import ModelConfig, RLConfig, TaskConfig


def task_configs(cfg: RLConfig) -> list[TaskConfig]:
    """cfg.tasks, or the default task made of the data and agent_loop sections."""
    return list(cfg.tasks) or [
        TaskConfig(name="default", weight=1.0, data=cfg.data, agent_loop=cfg.agent_loop)
    ]


def critic_kwargs(cfg: RLConfig) -> dict:
    """The constructor arguments of the run's critic (rlmega.learner.critic_api.Critic): the critic section
    with its nulls resolved (path and dtype from model, layout from parallelism, token budget from actor,
    the loss aggregation of the policy loss)."""
    c = cfg.critic
    algorithm = dataclasses.replace(cfg.algorithm).resolve_defaults()
    return dict(
        model=ModelConfig(
            path=c.path or cfg.model.path,
            dtype=c.dtype or cfg.model.dtype,
            seed=cfg.model.seed,
            allow_untested_family=cfg.model.allow_untested_family,
        ),
        parallel=c.parallelism or cfg.parallelism,
        optimizer=c.optimizer,
        critic=c,
        max_tokens_per_micro_batch=c.max_tokens_per_micro_batch
        or cfg.actor.max_tokens_per_micro_batch,
        loss_agg_mode=algorithm.loss_agg_mode,
    )


def trainer_ranks(cfg: RLConfig) -> int:
    """The run's trainer ranks: the policy's (parallelism.world_size) and the critic's (critic_ranks)."""
    return cfg.parallelism.world_size + critic_ranks(cfg)


def teacher_models(cfg: RLConfig) -> list[ModelConfig]:
    """The distillation teachers as the trainer ranks build them: each one's folder, in the policy's dtype."""
    m = cfg.model
    return [
        ModelConfig(
            path=t.path, dtype=m.dtype, seed=m.seed, allow_untested_family=m.allow_untested_family
        )
        for t in cfg.distillation.teachers
    ]


def teacher_identities(cfg: RLConfig) -> list[dict]:
    """Each distillation teacher as a checkpoint records it: its folder, the fingerprint of its model
    (rlmega.config.model_files.model_identity), its weight and tasks."""
    from rlmega.config.model_files import model_identity

    return [
        {
            "path": os.path.abspath(t.path),
            "identity": model_identity(t.path),
            "weight": t.weight,
            "tasks": list(t.tasks),
        }
        for t in cfg.distillation.teachers
    ]
