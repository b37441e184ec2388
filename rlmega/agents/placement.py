"""Ray resources of the agent side: agent-loop actors and the judgers' actors, as placement-group
bundles of the run (one group, "agents", beside the trainer's and the engines').

Every agent-loop instance (the driver's, or each of num_ray_actors actors) builds its own judgers, so a
ray judger with num_actors k under a loop with N actors starts N x k judger actors.

roles_cpus adds them to the trainer's, critic's and engines' CPUs: what the whole run reserves on Ray, asked
by the launcher (rlmega.launch.roles, sizing an embedded Ray) and by the preflight (rlmega.preflight); here,
below both, because nothing in it needs Ray.
"""

from __future__ import annotations

import dataclasses

from rlmega.config.resolved import task_configs, trainer_ranks
from rlmega.config.schema import ClusterConfig, JudgerConfig, RewardConfig, RLConfig, TaskConfig


def effective_judgers(loop_cfg, reward_cfg, reward_cpus: float) -> list[JudgerConfig]:
    """The loop's judgers; none given: the reward section's (rlmega.judgers.factory.default_judgers), its
    actors reserving cluster.reward_cpus each."""
    from rlmega.judgers.factory import default_judgers

    if loop_cfg.judgers:
        return list(loop_cfg.judgers)
    return [dataclasses.replace(j, cpus_per_actor=reward_cpus) for j in default_judgers(reward_cfg)]


def _bundle(cpus: float, memory_mb: int) -> dict:
    return {"CPU": cpus, **({"memory": memory_mb * 2**20} if memory_mb else {})}


def judger_bundles(judgers: list[JudgerConfig]) -> list[dict]:
    """One bundle per actor the judgers start (ray: num_actors; model: its engine)."""
    out = []
    for j in judgers:
        if j.kind == "ray":
            out += [_bundle(j.cpus_per_actor, j.memory_mb_per_actor)] * j.num_actors
        elif j.kind == "model":  # its engine; on cuda with a GPU of its own
            out.append(
                {
                    **_bundle(j.cpus_per_actor, j.memory_mb_per_actor),
                    **({"GPU": 1} if j.device == "cuda" else {}),
                }
            )
    return out


def task_bundles(loop_cfg, judgers: list[JudgerConfig]) -> tuple[list[dict], list[list[dict]]]:
    """(the loop's actor bundles, the judger bundles of each loop instance)."""
    n = loop_cfg.num_ray_actors
    loops = [_bundle(loop_cfg.cpus_per_actor, loop_cfg.memory_mb_per_actor)] * n
    return loops, [judger_bundles(judgers) for _ in range(max(1, n))]


def agent_cpus(task_cfgs, reward_cfg, reward_cpus: float) -> float:
    """Ray CPUs every agent-loop and judger actor of the run reserves."""
    total = 0.0
    for t in task_cfgs:
        loops, judges = task_bundles(
            t.agent_loop, effective_judgers(t.agent_loop, reward_cfg, reward_cpus)
        )
        total += sum(b["CPU"] for b in loops) + sum(b["CPU"] for inst in judges for b in inst)
    return total


def roles_cpus(
    cluster: ClusterConfig,
    reward: RewardConfig,
    tasks: list[TaskConfig],
    trainer_ranks: int,
    engines: int,
) -> float:
    """Ray CPUs the run's roles reserve: ``trainer_ranks`` (the policy's and the critic's) and ``engines`` by the
    cluster section's per-role CPUs, and each task's agent-loop and judger actors."""
    return (
        trainer_ranks * cluster.actor_cpus_per_rank
        + engines * cluster.engine_cpus
        + agent_cpus(tasks, reward, cluster.reward_cpus)
    )


def run_cpus(cfg: RLConfig) -> float:
    """roles_cpus of the whole run: the one function here that reads every section it sums over."""
    return roles_cpus(
        cfg.cluster, cfg.reward, task_configs(cfg), trainer_ranks(cfg), cfg.rollout.num_engines
    )
