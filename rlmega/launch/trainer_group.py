"""The trainer ranks of a run: the backend's Actor (actor.backend) on Ray actors, or on torchrun's processes."""

from __future__ import annotations

import dataclasses

import ray

from rlmega.learner.actor_api import BackendFactory
from rlmega.config.placement_plan import PlacementPlan
from rlmega.config.schema import RLConfig
from rlmega.config.resolved import critic_kwargs, teacher_models
from rlmega.learner.critic_api import critic_factory
from rlmega.launch import torchrun_group
from rlmega.launch.worker_group import WorkerGroup


def start_trainer(
    cfg: RLConfig,
    plan: PlacementPlan,
    pgs: list,
    threads: int,
    swaps: bool,
    on_torchrun: bool,
    optimizer_steps_per_rl_step: int,
    timeout_s: float,
    wait: bool = True,
):
    """A WorkerGroup (one Ray actor per rank, in ``plan``'s slots) or, when this process is torchrun's
    rank 0, a TorchrunGroup over torchrun's processes; each rank builds the Actor of actor.backend.

    ``swaps``: the ranks release their device memory while the engines generate
    (actor.offload_while_generating, resolved); ``threads``: each rank's intra-op threads. ``wait``
    False: a WorkerGroup returns while its ranks still build (WorkerGroup.starting); torchrun's always waits.
    """
    p = cfg.parallelism
    kwargs = dict(
        model=cfg.model,
        parallel=p,
        optimizer=cfg.optimizer,
        actor=dataclasses.replace(cfg.actor, offload_while_generating=swaps),
        algorithm=cfg.algorithm,
        temperature=cfg.rollout.temperature,
        lr_decay_steps=cfg.trainer.total_steps * optimizer_steps_per_rl_step,
        num_threads=threads,
        teachers=teacher_models(cfg),
        offload_teachers=cfg.distillation.offload_teachers,
    )
    # builds the backend's Actor in each rank's process
    actor_factory = BackendFactory(cfg.actor.backend)
    if on_torchrun:
        return torchrun_group.TorchrunGroup(
            actor_factory,
            p.world_size,
            kwargs=kwargs,
            timeout_s=timeout_s,
            ray_address=ray.get_runtime_context().gcs_address,
        )
    return WorkerGroup(
        actor_factory,
        p.world_size,
        kwargs=kwargs,
        num_cpus=cfg.cluster.actor_cpus_per_rank,
        num_gpus=plan.ranks[0].gpus,
        placement_group=[(pgs[s.group], s.bundles[0]) for s in plan.ranks],
        timeout_s=timeout_s,
        wait=wait,
    )


def start_critic(
    cfg: RLConfig,
    plan: PlacementPlan,
    pgs: list,
    threads: int,
    swaps: bool,
    optimizer_steps_per_rl_step: int,
    timeout_s: float,
    wait: bool = True,
):
    """The critic's ranks (algorithm.advantage_estimator=gae): a WorkerGroup in ``plan.critics``' slots,
    each building the Critic of actor.backend (rlmega.learner.critic_api). ``swaps``: they release their device
    memory while the engines generate (critic.offload_while_generating, resolved). The critic takes as
    many optimizer steps per RL step as the actor (one per mini-batch): its LR schedule has the same clock."""
    kwargs = critic_kwargs(cfg)
    kwargs.update(
        critic=dataclasses.replace(cfg.critic, offload_while_generating=swaps),
        num_threads=threads,
        lr_decay_steps=cfg.trainer.total_steps * optimizer_steps_per_rl_step,
    )
    return WorkerGroup(
        critic_factory(cfg.actor.backend),
        len(plan.critics),
        kwargs=kwargs,
        num_cpus=cfg.cluster.actor_cpus_per_rank,
        num_gpus=plan.critics[0].gpus,
        placement_group=[(pgs[s.group], s.bundles[0]) for s in plan.critics],
        timeout_s=timeout_s,
        name="critic",
        wait=wait,
    )
