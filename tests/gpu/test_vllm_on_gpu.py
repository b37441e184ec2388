"""vLLM on CUDA beside a Megatron trainer on the same GPU: the colocated RL cycle without Ray.

What the GPU proof list (docs/gpu.md) asks of one GPU (items 2 and 3), in one spawned process:
- a RolloutWorker engine on the GPU (bf16) generates; ``sleep(1)`` frees its device memory and
  ``wake_up`` brings it back, and what it generates then matches the trainer's log-probs;
- the trainer (MegatronActor, bf16 compute, fp32 log-probs) scores the engine's samples: the parity of
  engine vs trainer log-probs in bf16 on the same weights, before any update and after each one;
- three colocated RL steps: the engine sleeps while the trainer onloads and trains, the trainer
  releases all but its parameters, the engine wakes, the weights sync, the trainer releases its
  parameters too, the engine generates. The first refit goes through host shared memory
  (``DirectTransport``), the others as CUDA IPC handles of the trainer's tensors (``ipc_bucket``, the
  records ``CudaIpcTransport`` sends, opened by the engine's worker process). Step time by phase,
  refit seconds and peak memory are printed and returned;
- CUDA graphs: the eager engine goes, an engine with ``enforce_eager=False`` (vLLM's compile and
  CUDA graphs) starts, takes the trainer's last weights through CUDA IPC (a reload into the memory
  the captured graphs read) and generates the same requests: its log-probs against the trainer's,
  and its generation time against the eager engine's on the same weights and requests.

The model is a Qwen2.5-0.5B shape (896 wide, 24 layers, tied embeddings, vocabulary 151,936) with
random weights, made on the spot. Skipped without CUDA or without vLLM (tests/gpu/conftest.py; the
GPU machine carries vLLM as tools/gpu/README.md describes).

    python -m pytest tests/gpu/test_vllm_on_gpu.py -s
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time

import pytest
import torch

from rlmega.testing import multiproc

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)
run_on_ranks = functools.partial(multiproc.run_on_ranks, start_method="spawn")

# Qwen2.5-0.5B's shape (random weights): tied embeddings, the path the audit found drifting on CPU.
SHAPE = dict(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
)
PROMPTS = [[1] + [4 + (13 * i + 7 * j) % 60 for j in range(40 + 30 * i)] for i in range(8)]
N, MAX_TOKENS, STEPS = 4, 128, 3
GiB = 1 << 30
# The engine's attention kernels by name (e.g. TRITON_ATTN when vLLM was carried without its flash-attention
# libraries, tools/gpu/README.md); unset: vLLM's own choice.
ATTENTION_ENV = "RLMEGA_TEST_ATTENTION_BACKEND"


def _free() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GiB


class _IpcDirect:
    """``CudaIpcTransport``'s sending side with ``DirectTransport``'s calls: the GPU machine has no Ray.
    Each bucket goes as CUDA IPC records of the trainer's tensors (``ipc_bucket``); the RolloutWorker
    writes them to its sync folder and the engine's worker process opens them. The tensors are held
    until the flush has returned, as CudaIpcTransport holds them."""

    takes_pieces = False

    def __init__(self, engines):
        from rlmega.sync.transports import DirectTransport

        self.direct, self.held = DirectTransport(engines), []

    def send(self, bucket, version):
        from rlmega.sync.cuda_ipc import ipc_bucket

        records, kept = ipc_bucket(bucket)
        self.held += kept
        self.direct.send(records, version)

    def flush(self):
        try:
            self.direct.flush()
        finally:
            self.held.clear()


def _cycle_body(model_dir: str) -> dict:
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.data.samples import batch_from_samples
    from rlmega.megatron.actor import MegatronActor
    from rlmega.sync.parity import logprob_diff
    from rlmega.sync.transports import DirectTransport
    from rlmega.testing.rl_step import OneRank, train_step_on_fixed_rewards
    from rlmega.rollout.rollout import RolloutWorker

    out: dict = {"free_at_start_gib": _free()}
    t0 = time.perf_counter()
    # The engine first: its engine core is a child process, started before this one holds CUDA state.
    engine = RolloutWorker(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        gpu_memory_utilization=0.35,
        attention_backend=os.environ.get(ATTENTION_ENV),
    )
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
    # Equal tokens are not guaranteed: bf16 kernels differ with the batch's make-up, which differs between a
    # cold engine and a warm one (on the H200 they differed; on the H100 they were equal). The check that
    # the woken weights are intact is the first parity below, computed on these samples.
    out["same_samples_after_wake"] = sum(
        a.response_ids == b.response_ids for a, b in zip(again, samples)
    )
    samples = again

    actor = MegatronActor(
        ModelConfig(path=model_dir, dtype="bfloat16"),
        ParallelismConfig(),
        OptimizerConfig(lr=1e-5),
        ActorConfig(max_tokens_per_micro_batch=8192, offload_while_generating=True),
        AlgorithmConfig(kl_coef=0.0),
    )
    actor.setup(with_reference=False)
    group = OneRank(actor)
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
        ph["train_s"], ph["loss"], ph["grad_norm"] = (
            time.perf_counter() - t,
            metrics["loss"],
            metrics["grad_norm"],
        )
        ph["free_training_gib"] = _free()
        t = time.perf_counter()
        actor.offload_for_rollout(keep_params=True)
        engine.wake_up()
        ph["to_rollout_s"] = time.perf_counter() - t
        t = time.perf_counter()
        transport = DirectTransport([engine]) if step == 0 else _IpcDirect([engine])
        try:
            sent = actor.sync_model_to_rollout(transport, version=step + 1)
        # noted (the test fails on it), and the cycle goes on through host memory
        except Exception as e:
            ph["refit_error"] = f"{type(transport).__name__}: {type(e).__name__}: {e}"
            print("REFIT FAILED:", ph["refit_error"], flush=True)
            try:  # ends a sync the failed transport left open (a send that raised before its flush)
                transport.flush()
            except Exception:
                pass
            # as another version: the engine refuses a failed one's
            transport = DirectTransport([engine])
            sent = actor.sync_model_to_rollout(transport, version=100 + step + 1)
        ph["refit_s"], ph["refit_gib"] = time.perf_counter() - t, sent["bytes"] / GiB
        ph["refit_via"] = type(transport).__name__
        actor.offload_for_rollout()
        ph["free_generating_gib"] = _free()
        old = samples
        samples, ph["generate_s"] = generate(step + 1)
        ph["engine_changed"] = any(a.logprobs != b.logprobs for a, b in zip(old, samples))
        steps.append(ph)
        print("STEP", json.dumps(ph), flush=True)
    # The last step's requests once more, timed as the compiled engine's are below (its second call).
    _, out["eager_generate_again_s"] = generate(STEPS)
    actor.onload_for_training()
    batch = batch_from_samples(samples)
    diffs.append(
        logprob_diff(batch.rollout_logprobs, actor.compute_logprobs(batch), batch.response_mask)
    )
    out.update(
        steps=steps,
        parity=diffs,
        engine_version=engine.weight_version(),
        trainer_peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
        device=torch.cuda.get_device_name(),
        vllm=__import__("vllm").__version__,
        attention_backend=os.environ.get(ATTENTION_ENV) or "(vLLM's choice)",
    )
    engine.shutdown()
    print("EAGER", json.dumps(out), flush=True)
    try:
        out["cuda_graphs"] = _with_cuda_graphs(
            actor, model_dir, samples, out["eager_generate_again_s"]
        )
    except Exception as e:  # the eager part's results still come back
        out["cuda_graphs"] = {"error": f"{type(e).__name__}: {e}"}
    actor.teardown()
    return out


def _with_cuda_graphs(actor, model_dir: str, samples, eager_generate_s: float) -> dict:
    """A compiled engine (CUDA graphs) takes the trainer's last weights through CUDA IPC and generates
    what the eager engine last did (``samples``; ``eager_generate_s``: the eager engine's second call
    of them): same requests, seed, weights. Then it sleeps and wakes up, and generates again."""
    from rlmega.data.samples import batch_from_samples
    from rlmega.sync.parity import logprob_diff
    from rlmega.rollout.rollout import RolloutWorker

    actor.offload_for_rollout(keep_params=True)
    t0 = time.perf_counter()
    engine = RolloutWorker(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        gpu_memory_utilization=0.35,
        attention_backend=os.environ.get(ATTENTION_ENV),
        enforce_eager=False,
    )
    graphs = {"engine_start_s": time.perf_counter() - t0}

    def generate(seed):
        t = time.perf_counter()
        got = engine.generate(PROMPTS, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
        return got, time.perf_counter() - t

    try:
        at_start, _ = generate(STEPS)  # the model folder's weights, before any sync
        t = time.perf_counter()
        actor.sync_model_to_rollout(_IpcDirect([engine]), version=STEPS)
        graphs["refit_s"] = time.perf_counter() - t
        _, graphs["generate_first_s"] = generate(STEPS)
        graph_samples, graphs["generate_s"] = generate(STEPS)
        graphs["response_tokens"] = sum(len(s.response_ids) for s in graph_samples)
        graphs["eager_generate_s"] = eager_generate_s  # the same requests, seed and weights, eager
        graphs["eager_response_tokens"] = sum(len(s.response_ids) for s in samples)
        graphs["same_tokens_as_eager"] = [s.response_ids for s in graph_samples] == [
            s.response_ids for s in samples
        ]
        # Sleep and wake a compiled engine, as the colocated cycle does (the graphs stay captured).
        awake = _free()
        engine.sleep(1)
        graphs["freed_by_sleep_gib"] = _free() - awake
        engine.wake_up()
        woken, _ = generate(STEPS)
        actor.onload_for_training()
        for key, got in (
            ("parity_before_sync", at_start),
            ("parity", graph_samples),
            ("parity_after_wake", woken),
        ):
            b = batch_from_samples(got)
            graphs[key] = logprob_diff(
                b.rollout_logprobs, actor.compute_logprobs(b), b.response_mask
            )
    finally:
        engine.shutdown()
    return graphs


def test_engine_and_trainer_share_one_gpu_through_colocated_steps(tmp_path):
    from rlmega.demo.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "qwen2_0.5b_shape", **SHAPE, seed=3))
    r = run_on_ranks(_cycle_body, 1, args=(model_dir,), timeout_s=900)[0]
    print(json.dumps(r, indent=1))
    out = os.environ.get("RLMEGA_GPU_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(r, f, indent=1)
    assert r["response_tokens"] > 0
    # Sleep level 1 offloads the weights and drops the KV cache: several GiB come back to the device.
    assert r["free_engine_asleep_gib"] > r["free_engine_awake_gib"] + 1.0
    assert r["engine_version"] == STEPS and all(s["engine_changed"] for s in r["steps"])
    # bf16 on both sides with different kernels: the gap is bf16 rounding, not other weights. An engine
    # that kept its old weights would be off by the update itself, step after step. The first one is on
    # samples generated after sleep/wake_up: the woken weights are the trainer's.
    for d in r["parity"]:
        assert d["mean"] < 0.05, r["parity"]
    assert [s["refit_via"] for s in r["steps"]] == ["DirectTransport"] + ["_IpcDirect"] * (
        STEPS - 1
    ), r["steps"]
    # The compiled engine took the synced weights: its log-probs match the trainer's as the eager ones do,
    # and before the sync (the model folder's weights) they did not (measured: mean 0.0088 vs 0.176).
    g = r["cuda_graphs"]
    assert "error" not in g, g
    assert (
        g["response_tokens"] > 0 and g["parity"]["mean"] < 0.05 < g["parity_before_sync"]["mean"]
    ), g
    assert g["parity_after_wake"]["mean"] < 0.05 and g["freed_by_sleep_gib"] > 1.0, g
