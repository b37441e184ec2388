"""Every task's agent loop with its judgers, their actors in one placement group of the run ("agents")."""

from __future__ import annotations

import dataclasses

import ray

from rlmega.agents.hosting import AgentLoopHost, BackgroundLoop, LoopSpec
from rlmega.agents.placement import effective_judgers, task_bundles
from rlmega.config.resolved import task_configs
from rlmega.config.schema import RLConfig
from rlmega.launch.cluster import ClusterError


def start_agent_loops(
    cfg: RLConfig, engines: list, pg_timeout_s: float
) -> tuple[dict, BackgroundLoop, object]:
    """Every task's agent loop (here or in its actors) with its judgers, their actors in one placement
    group of the run ("agents"); see rlmega/agents/placement.py."""
    from ray.util.placement_group import placement_group, remove_placement_group

    r, plans = cfg.rollout, []
    for task in task_configs(cfg):
        judgers = effective_judgers(task.agent_loop, cfg.reward, cfg.cluster.reward_cpus)
        loops, judges = task_bundles(task.agent_loop, judgers)
        plans.append((task, judgers, loops, judges))
    bundles = [
        b for _, _, loops, judges in plans for b in loops + [x for inst in judges for x in inst]
    ]
    pg = None
    if bundles:
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=pg_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)  # not handed back to Roles yet: nobody else would remove it
            raise ClusterError(
                f"the agent-loop and judger actors' {len(bundles)} bundles "
                f"({sum(b['CPU'] for b in bundles):g} CPUs) could not be placed within "
                f"{pg_timeout_s:.0f}s. Fix: lower agent_loop.cpus_per_actor / the judgers' "
                "cpus_per_actor, or give the cluster more CPUs"
            ) from None
    background, hosts = BackgroundLoop(), {}
    index = 0
    for task, judgers, loops, judges in plans:
        loop_bundles = [(pg, index + i) for i in range(len(loops))]
        index += len(loops)
        judger_bundles = []
        for inst in judges:
            judger_bundles.append([(pg, index + i) for i in range(len(inst))])
            index += len(inst)
        spec = LoopSpec(
            task=task.name,
            agent_loop=dataclasses.replace(task.agent_loop, judgers=judgers),
            reward=cfg.reward,
            model_path=cfg.model.path,
            sampling=dict(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_response_tokens,
            ),
            n=r.n,
        )
        hosts[task.name] = AgentLoopHost(spec, engines, loop_bundles, judger_bundles)
    return hosts, background, pg
