"""vLLM on CUDA beside a Megatron trainer on the same GPU: the colocated RL cycle without Ray.

What the GPU proof list (docs/gpu.md) asks of one GPU (items 2 and 3), in one spawned process:
- a RolloutWorker engine on the GPU (bf16) generates; ``sleep(1)`` frees its device memory and
  ``wake_up`` brings it back, and the same seeded request then gives the same tokens;
- the trainer (MegatronActor, bf16 compute, fp32 log-probs) scores the engine's samples: the parity of
  engine vs trainer log-probs in bf16 on the same weights, before any update and after each one;
- three colocated RL steps: the engine sleeps while the trainer onloads and trains, the trainer
  releases all but its parameters, the engine wakes, the weights sync (``DirectTransport``: the reload
  path, ``RolloutWorker.update_weights``), the trainer releases its parameters too, the engine
  generates. Step time by phase, refit seconds and peak memory are printed and returned.

The model is a Qwen2.5-0.5B shape (896 wide, 24 layers, tied embeddings, vocabulary 151,936) with
random weights, made on the spot. Skipped without CUDA or without vLLM (tests/gpu/conftest.py; the
GPU machine carries vLLM as tools/gpu/README.md describes).

    python -m pytest tests/gpu/test_vllm_on_gpu.py -s
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import time

import pytest
import torch

from rlmega.testing import multiproc

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
run_on_ranks = functools.partial(multiproc.run_on_ranks, start_method="spawn")

# Qwen2.5-0.5B's shape (random weights): tied embeddings, the path the audit found drifting on CPU.
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1000000.0)
PROMPTS = [[1] + [4 + (13 * i + 7 * j) % 60 for j in range(40 + 30 * i)] for i in range(8)]
N, MAX_TOKENS, STEPS = 4, 128, 3
GiB = 1 << 30
# The engine's attention kernels by name (e.g. TRITON_ATTN when vLLM was carried without its flash-attention
# libraries, tools/gpu/README.md); unset: vLLM's own choice.
ATTENTION_ENV = "RLMEGA_TEST_ATTENTION_BACKEND"


def _free() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GiB


class _Local:
    """One in-process actor as a one-rank WorkerGroup (``call`` returns [result])."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, name, *args, **kwargs):
        return [getattr(self.actor, name)(*args, **kwargs)]


def _cycle_body(model_dir: str) -> dict:
    from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.data.samples import batch_from_samples
    from rlmega.megatron.actor import MegatronActor
    from rlmega.sync.parity import logprob_diff
    from rlmega.sync.transports import DirectTransport
    from rlmega.testing.rl_step import train_step_on_fixed_rewards
    from rlmega.workers.rollout import RolloutWorker

    out: dict = {"free_at_start_gib": _free()}
    t0 = time.perf_counter()
    # The engine first: its engine core is a child process, started before this one holds CUDA state.
    engine = RolloutWorker(model_dir, device="cuda", dtype="bfloat16", max_model_len=1024, seed=0,
                           gpu_memory_utilization=0.35, attention_backend=os.environ.get(ATTENTION_ENV))
    out["engine_start_s"] = time.perf_counter() - t0

    def generate(seed):
        t = time.perf_counter()
        samples = engine.generate(PROMPTS, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
        return samples, time.perf_counter() - t

    samples, out["generate_s"] = generate(0)
    out["response_tokens"] = sum(len(s.response_ids) for s in samples)
    out["free_engine_awake_gib"] = _free()
    t = time.perf_counter()
    engine.sleep(1)
    out["sleep_s"], out["free_engine_asleep_gib"] = time.perf_counter() - t, _free()
    t = time.perf_counter()
    engine.wake_up()
    out["wake_s"], out["free_engine_woken_gib"] = time.perf_counter() - t, _free()
    again, _ = generate(0)
    out["same_tokens_after_wake"] = [s.response_ids for s in again] == [s.response_ids for s in samples]

    actor = MegatronActor(ModelConfig(path=model_dir, dtype="bfloat16"), ParallelismConfig(),
                          OptimizerConfig(lr=1e-5), ActorConfig(max_tokens_per_micro_batch=8192,
                                                                offload_while_generating=True),
                          AlgorithmConfig(kl_coef=0.0))
    actor.setup(with_reference=False)
    group = _Local(actor)
    torch.cuda.reset_peak_memory_stats()
    steps, diffs = [], []
    for step in range(STEPS):
        ph: dict = {}
        batch = batch_from_samples(samples)
        t = time.perf_counter()
        engine.sleep(1)
        actor.onload_for_training()
        ph["to_train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lp = actor.compute_logprobs(batch)
        diffs.append(logprob_diff(batch.rollout_logprobs, lp, batch.response_mask))
        metrics = train_step_on_fixed_rewards(group, batch)
        torch.cuda.synchronize()
        ph["train_s"], ph["loss"], ph["grad_norm"] = time.perf_counter() - t, metrics["loss"], metrics["grad_norm"]
        ph["free_training_gib"] = _free()
        t = time.perf_counter()
        actor.offload_for_rollout(keep_params=True)
        engine.wake_up()
        ph["to_rollout_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sent = actor.sync_model_to_rollout(DirectTransport([engine]), version=step + 1)
        ph["refit_s"], ph["refit_gib"] = time.perf_counter() - t, sent["bytes"] / GiB
        actor.offload_for_rollout()
        ph["free_generating_gib"] = _free()
        old = samples
        samples, ph["generate_s"] = generate(step + 1)
        ph["engine_changed"] = any(a.logprobs != b.logprobs for a, b in zip(old, samples))
        steps.append(ph)
    actor.onload_for_training()
    batch = batch_from_samples(samples)
    diffs.append(logprob_diff(batch.rollout_logprobs, actor.compute_logprobs(batch), batch.response_mask))
    out.update(steps=steps, parity=diffs, engine_version=engine.weight_version(),
               trainer_peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
               device=torch.cuda.get_device_name(), vllm=__import__("vllm").__version__,
               attention_backend=os.environ.get(ATTENTION_ENV) or "(vLLM's choice)")
    engine.shutdown()
    actor.teardown()
    return out


def test_engine_and_trainer_share_one_gpu_through_colocated_steps(tmp_path):
    from rlmega.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "qwen2_0.5b_shape", **SHAPE, seed=3))
    r = run_on_ranks(_cycle_body, 1, args=(model_dir,), timeout_s=900)[0]
    print(json.dumps(r, indent=1))
    out = os.environ.get("RLMEGA_GPU_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(r, f, indent=1)
    assert r["response_tokens"] > 0 and r["same_tokens_after_wake"]
    # Sleep level 1 offloads the weights and drops the KV cache: several GiB come back to the device.
    assert r["free_engine_asleep_gib"] > r["free_engine_awake_gib"] + 1.0
    assert r["engine_version"] == STEPS and all(s["engine_changed"] for s in r["steps"])
    # bf16 on both sides with different kernels: the gap is bf16 rounding, not other weights. An engine
    # that kept its old weights would be off by the update itself, step after step.
    for d in r["parity"]:
        assert d["mean"] < 0.05, r["parity"]
