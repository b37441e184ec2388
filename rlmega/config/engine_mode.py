"""How the rollout engines run, resolved from the config and the model folder (no Ray, no vLLM here:
the preflight and the launcher both ask).

    records_routes(cfg)  the engines record each token's routed experts (MoE on the Megatron backend)
    enforce_eager(cfg)   vLLM runs eager (True) or compiled with CUDA graphs (False)
    cuda_graph_max_batch(cfg, eval_requests)   the largest CUDA graph a compiled engine captures
"""

from __future__ import annotations

import json
import math
import os

from rlmega.config.agent_rules import task_loops
from rlmega.config.hf_support import num_experts
from rlmega.config.schema import RLConfig


def records_routes(cfg: RLConfig) -> bool:
    """Whether the engines record each token's routed experts: every mixture-of-experts model trained
    by the Megatron backend (config.json at model.path names routed experts), whatever
    ``algorithm.routing_replay`` says. The trainer replays them only under ``rollout`` (R3); under
    ``none`` and ``trainer`` they are what ``router_mismatch`` (the trainer's live top-k vs the engine's,
    without replay) is measured against. Never for a dense model: its engines get no capture hooks at
    all, so a dense run costs nothing. Not for actor.backend=fsdp, which has no routing replay.

    Recording needs an eager engine (CUDA-graph replay never calls the capture hook): ``enforce_eager``
    resolves to True then, and the preflight refuses ``rollout.enforce_eager: false`` with it.
    """
    if cfg.actor.backend != "megatron":
        return False
    path = os.path.join(cfg.model.path, "config.json")
    # the preflight requires one; without it there is nothing to record
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        hf = json.load(f)
    return isinstance(hf, dict) and num_experts(hf) > 0


def enforce_eager(cfg: RLConfig) -> bool:
    """``rollout.enforce_eager`` resolved: the value set, else eager on CPU and while the engines record
    routes, CUDA graphs on CUDA.

    Why (measured, docs/speed.md): on an H200 (vLLM 0.26, Qwen2.5-0.5B shape, 32 samples x 128 tokens)
    the compiled engine generated in 0.43 s what the eager one did in 3.0-4.4 s (~7x; docs/speed.md says
    why the timings differ in kind), with the same log-prob parity to the trainer after a weight sync
    (mean 0.0088 vs 0.0089). vLLM's own sleep-mode tests run its default, compiled engine; rlmega has
    not yet slept a compiled engine on a GPU (tests/gpu/test_vllm_on_gpu.py does, on the next lease). On
    this project's 2-core CPU machine compiling doubled the engine's start (11.9 -> 23.7 s) to save ~10%
    of generation.
    """
    set_value = cfg.rollout.enforce_eager
    if set_value is not None:
        return bool(set_value)
    return cfg.rollout.device == "cpu" or records_routes(cfg)


# vLLM's own default max_cudagraph_capture_size (1024 only on Blackwell data-centre GPUs)
VLLM_CAPTURE_CEILING = 512


def engine_batch_bound(cfg: RLConfig, eval_requests: int) -> int:
    """The most sequences one engine can be asked to hold at once in this run (an upper bound).

    Production has one batch in flight at a time (rlmega/agents/produce.py: a dynamic-sampling round, or a
    batch made ahead under async, waits for the one before): prompts_per_step groups of n sequences. An
    eval (``eval_requests`` prompts, one greedy sequence each) can run beside it under async. Each agent-loop
    process routes to the least-outstanding engine by its own counts (rlmega/agents/router.py), so with R
    such routers one engine may hold up to R more than an even share.
    """
    produced = cfg.trainer.prompts_per_step * cfg.rollout.n
    evals = eval_requests if cfg.trainer.eval_every else 0
    routers = sum(max(1, loop.num_ray_actors) for _, loop in task_loops(cfg))
    return math.ceil((produced + evals) / cfg.rollout.num_engines) + routers


def capture_grid_size(n: int) -> int:
    """The smallest size on vLLM's CUDA-graph capture grid that holds ``n`` sequences, at most its ceiling.

    vLLM captures [1, 2, 4], multiples of 8 below 256 and multiples of 16 from 256 up to the maximum
    (vllm/config/vllm.py, _set_cudagraph_sizes), and truncates a maximum off that grid to the size below,
    so that a batch of exactly ``n`` would run eagerly.
    """
    if n <= 4:
        return next(s for s in (1, 2, 4) if s >= n)
    step = 8 if n < 256 else 16
    return min(-(-n // step) * step, VLLM_CAPTURE_CEILING)


def cuda_graph_max_batch(cfg: RLConfig, eval_requests: int | None) -> int | None:
    """vLLM's ``max_cudagraph_capture_size`` for this run's engines: rollout.cuda_graph_max_batch if set,
    else the grid size holding ``engine_batch_bound``. None: vLLM's default (an eager engine captures
    nothing; ``eval_requests`` None: the eval set's size is not known to the caller)."""
    if enforce_eager(cfg):
        return None
    if cfg.rollout.cuda_graph_max_batch is not None:
        return cfg.rollout.cuda_graph_max_batch
    if eval_requests is None:
        return None
    return capture_grid_size(engine_batch_bound(cfg, eval_requests))
