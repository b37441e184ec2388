"""The rollout engines as Ray actors: their actor class, their options in a placement slot, starting them.

engines = start_engines(cfg, pgs, plan.engines, engine_threads, profile_dir, eval_requests)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from rlmega.config.agent_rules import observed_images, task_loops
from rlmega.config.engine_mode import cuda_graph_max_batch, enforce_eager, records_routes
from rlmega.config.placement_plan import Slot
from rlmega.config.schema import RLConfig
from rlmega.data.images import is_vlm_folder
from rlmega.rollout.rollout import GENERATION_GROUP, RolloutWorker

log = logging.getLogger("rlmega")

# Generation calls one engine actor runs at once (threads; most wait on the engine): requests in flight
# per engine, in its GENERATION_GROUP. Its other calls (weight buckets, pause/resume, versions) have
# threads of their own, ENGINE_CONTROL_CONCURRENCY: enough for every sender's buckets in flight
# (RayTransport: 2 per trainer rank) on big layouts.
ENGINE_MAX_CONCURRENCY = 1024
ENGINE_CONTROL_CONCURRENCY = 256


def engine_actor_class(generation_threads: int = ENGINE_MAX_CONCURRENCY):
    """RolloutWorker as a Ray actor class whose generation calls run in their own concurrency group.

    Requests waiting at a paused engine (an in-flight weight sync) hold their threads; in a group of
    their own they can never take the threads the sync that reopens the engine needs. Start it with
    ``.options(max_concurrency=ENGINE_CONTROL_CONCURRENCY, ...)`` for the other calls.
    """
    return ray.remote(concurrency_groups={GENERATION_GROUP: generation_threads})(RolloutWorker)  # type: ignore[call-overload]


def start_engines(
    cfg: RLConfig,
    pgs: list,
    slots: list[Slot],
    threads: list,
    profile_dir: str | None,
    eval_requests: int | None = None,
) -> list:
    """One RolloutWorker actor per engine slot (``threads[i]``: engine i's intra-op threads), started
    with the model at model.path; returns their handles (they load the model in the background).
    ``eval_requests``: the eval prompts of the run, which size a compiled engine's CUDA graphs (None:
    unknown, vLLM's default sizes)."""
    r, Engine, engines = cfg.rollout, engine_actor_class(), []
    # resolved here: an engine on another node has another working directory
    cache_dir = os.path.abspath(os.path.expanduser(r.cache_dir)) if r.cache_dir else None
    graphs = cuda_graph_max_batch(cfg, eval_requests)
    if graphs is not None:
        log.info(
            "rollout engines: CUDA graphs for batches up to %d sequences (rollout.cuda_graph_max_batch)",
            graphs,
        )
    for i, slot in enumerate(slots):
        engines.append(
            Engine.options(**engine_options(pgs[slot.group], slot)).remote(
                cfg.model.path,
                device=r.device,
                dtype=cfg.model.dtype,
                max_model_len=r.max_prompt_tokens + r.max_response_tokens,
                seed=r.seed + i,
                kv_cache_space_gb=r.kv_cache_space_gb,
                gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_parallel_size,
                profile_dir=profile_dir,
                num_threads=threads[i],
                record_routes=records_routes(cfg),
                enforce_eager=enforce_eager(cfg),
                attention_backend=r.attention_backend,
                cache_dir=cache_dir,
                cuda_graph_max_batch=graphs,
                lora_rank=cfg.actor.lora.rank
                if not r.lora_merge
                else 0,  # served unmerged: load_adapter
                images_per_prompt=images_per_request(cfg) if is_vlm_folder(cfg.model.path) else 0,
            )
        )
    return engines


def images_per_request(cfg: RLConfig) -> int:
    """vLLM's limit_mm_per_prompt: a prompt's images (rollout.max_images_per_prompt) and the most image
    observations a tool loop adds to one request (agent_rules.observed_images)."""
    return cfg.rollout.max_images_per_prompt + max(
        observed_images(loop) for _, loop in task_loops(cfg)
    )


def engine_options(pg, slot: Slot) -> dict:
    """Ray options of one engine actor in its placement slot.

    vLLM TP = 1: the actor itself takes its share of its bundle's GPU. TP = k > 1: the actor takes no
    GPU; vLLM's Ray executor starts one worker per bundle of the slot (VLLM_RAY_BUNDLE_INDICES, each
    taking VLLM_RAY_PER_WORKER_GPUS) inside the actor's placement group, which it finds because the
    actor captures child tasks (vllm/config/parallel.py picks the "ray" backend in a placement group).

    A threaded actor (``engine_actor_class``): ENGINE_MAX_CONCURRENCY threads in its generation group,
    so that many callers' ``generate_one`` (and ``generate``) calls are in the engine at once and vLLM
    batches them continuously, and ``max_concurrency=ENGINE_CONTROL_CONCURRENCY`` for the other calls
    (``abort``, weight buckets, pause/resume); each call's thread waits on the engine's own asyncio
    loop (rlmega/rollout/rollout.py). Order
    between calls no longer matters: the pipelined RayTransport's buckets used to need Ray's in-order
    execution of one caller's update_weights calls, but RolloutWorker.update_weights is thread-safe
    and holds back every fused layer until all its tensors arrived, whatever order or threads they
    come in, and RayTransport.flush still waits for every bucket before the sync reports its version.
    No task retries: a retried update_weights or generate would run twice.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    many = len(slot.bundles) > 1
    options: dict[str, Any] = dict(
        num_cpus=slot.cpus,
        num_gpus=0 if many else slot.gpus,
        max_concurrency=ENGINE_CONTROL_CONCURRENCY,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=slot.bundles[0],
            placement_group_capture_child_tasks=many,
        ),
    )
    if many:
        options["runtime_env"] = {
            "env_vars": {
                "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, slot.bundles)),
                "VLLM_RAY_PER_WORKER_GPUS": str(slot.gpus),
            }
        }
    return options
