"""Build an agent loop's judgers from its config section.

    judge = build_judger(cfg.agent_loop.judgers, cfg.reward, placement_group=pg)
    verdict = await judge.judge(item)

An empty list means one judger from the reward section, named "reward": kind ray with
reward.num_workers actors (kind native when num_workers is 0), reward.fn, reward.kwargs and
reward.timeout_s. A judger whose fn is "" uses reward.fn. The list is checked first
(rlmega.config.judger_rules), so a bad one raises ConfigError naming every bad field, before any actor or
engine starts. Every judger always scores a failure 0 with a flag; reward.on_error="fail" is the
caller's policy on those flags.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlmega.config.judger_rules import validate_judgers
from rlmega.config.schema import JudgerConfig, RewardConfig
from rlmega.judgers.base import Judger
from rlmega.judgers.composite import CompositeJudger


def default_judgers(reward_cfg: RewardConfig) -> list[JudgerConfig]:
    """The judger an agent loop without judgers gets: the reward section's function."""
    return [
        JudgerConfig(
            name="reward",
            kind="ray" if reward_cfg.num_workers > 0 else "native",
            fn=reward_cfg.fn,
            kwargs=dict(reward_cfg.kwargs),
            timeout_s=reward_cfg.timeout_s,
            num_actors=max(reward_cfg.num_workers, 1),
        )
    ]


def actors_of(c: JudgerConfig) -> int:
    """Ray actors judger `c` starts: ray num_actors, model one (its engine), native and http none."""
    return c.num_actors if c.kind == "ray" else 1 if c.kind == "model" else 0


def make_judger(
    c: JudgerConfig,
    reward_cfg: RewardConfig,
    placement_group=None,
    engine_kwargs: dict | None = None,
    bundles: list | None = None,
) -> Judger:
    """One judger of kind c.kind (imports only what that kind needs: Ray, httpx, transformers).
    `bundles`: None, or one (placement group, bundle index) per actor it starts (actors_of(c))."""
    common = dict(timeout_s=c.timeout_s, weight=c.weight)
    if c.kind == "native":
        from rlmega.judgers.native import NativeJudger

        return NativeJudger(c.name, c.fn or reward_cfg.fn, kwargs=c.kwargs, **common)
    if c.kind == "ray":
        from rlmega.judgers.ray_actors import RayJudger

        return RayJudger(
            c.name,
            c.fn or reward_cfg.fn,
            kwargs=c.kwargs,
            num_actors=c.num_actors,
            cpus_per_actor=c.cpus_per_actor,
            memory_mb_per_actor=c.memory_mb_per_actor,
            placement_group=placement_group,
            bundles=bundles,
            **common,
        )
    if c.kind == "http":
        from rlmega.judgers.http import HttpJudger

        return HttpJudger(c.name, c.url, kwargs=c.kwargs, **common)
    if c.kind == "model":
        from rlmega.judgers.model import ModelJudger, engine_settings

        # the judger's fields, then overrides
        engine_kwargs = {**engine_settings(c), **(engine_kwargs or {})}
        num_gpus = 1.0 if engine_kwargs.get("device") == "cuda" else 0.0
        pg, index = bundles[0] if bundles else (placement_group, -1)
        return ModelJudger(
            c.name,
            c.model_path,
            prompt_template=c.prompt_template,
            max_tokens=c.max_tokens,
            cpus_per_actor=c.cpus_per_actor,
            memory_mb_per_actor=c.memory_mb_per_actor,
            num_gpus=num_gpus,
            placement_group=pg,
            bundle_index=index,
            engine_kwargs=engine_kwargs,
            **common,
        )
    raise ValueError(f"judger {c.name!r}: unknown kind {c.kind!r}")


def build_judger(
    cfgs: Sequence[JudgerConfig],
    reward_cfg: RewardConfig,
    placement_group=None,
    *,
    bundles: Sequence[tuple] | None = None,
    engine_kwargs: dict | None = None,
    field_prefix: str = "agent_loop.judgers",
) -> CompositeJudger:
    """The CompositeJudger of one agent loop. Placement of the ray and model judgers' actors: `bundles`,
    one (placement group, bundle index) per actor in judger order (rlmega.agents.placement.judger_bundles),
    or else `placement_group` (any bundle with room), or else none. `engine_kwargs` go to a model judge's
    RolloutWorker over the judger's own settings (rlmega.judgers.model.engine_settings). ConfigError when
    the list is invalid. If one judger fails to start, those already started are closed first."""
    from rlmega.config.validate import ConfigError

    if cfgs:
        cfgs = list(cfgs)
        problems = validate_judgers(cfgs, field_prefix, reward_cfg)
    else:  # the default judger's fields are the reward section's: name those
        cfgs = default_judgers(reward_cfg)
        problems = [
            p.replace(f"{field_prefix}[0].", "reward.", 1)
            for p in validate_judgers(cfgs, field_prefix, reward_cfg)
        ]
    if problems:
        raise ConfigError(problems)
    needed = sum(actors_of(c) for c in cfgs)
    if bundles and len(bundles) != needed:
        raise ValueError(f"{len(bundles)} placement bundles for the judgers' {needed} actors")
    judgers: list[Judger] = []
    start = 0
    try:
        for c in cfgs:
            mine = list(bundles[start : start + actors_of(c)]) if bundles else None
            start += actors_of(c)
            judgers.append(make_judger(c, reward_cfg, placement_group, engine_kwargs, mine))
    except BaseException:
        for j in judgers:
            j.close()
        raise
    return CompositeJudger(judgers)
