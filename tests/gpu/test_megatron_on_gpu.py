"""What one GPU can show of the Megatron side (world size 1, NCCL): device binding, collectives on
device tensors, a bf16 train step with the distributed optimizer, offload/onload really freeing
device memory, CUDA RNG state in checkpoints, and the MFU benchmark.

Each test runs its body in a fresh spawned rank (rlmega.testing.multiproc), as training does:
spawned, not forked from run_on_ranks' forkserver, whose preloaded imports may touch the CUDA driver
(a forked child then cannot use CUDA).
"""

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import torch

from rlmega.testing import multiproc

run_on_ranks = functools.partial(multiproc.run_on_ranks, start_method="spawn")

ROOT = Path(__file__).resolve().parents[2]
# A small Qwen2 shape built in code (random init, no weights): big enough that its state is
# hundreds of MiB on the device, so freeing it shows in torch.cuda.memory_allocated.
HF = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_hidden_layers=8,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)


def _manager(dtype="bfloat16"):
    from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.model_manager import MegatronModelManager

    mm = MegatronModelManager(
        ModelConfig(path="", dtype=dtype),
        ParallelismConfig(),
        OptimizerConfig(lr=1e-4, use_distributed_optimizer=True),
        hf_config=HF,
    )
    mm.setup_model_and_optimizer(load_weights=False)
    return mm


def _tokens(n=4, t=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, HF["vocab_size"], (n, t + 1), generator=g).cuda()


def _binding_body():
    import torch.distributed as dist

    from rlmega.megatron import pipeline_passes
    from rlmega.process.distributed import collective_device, device_ordinal
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1)
    out = {
        "backend": dist.get_backend(),
        "device": torch.cuda.current_device(),
        "ordinal": device_ordinal(0, 1, torch.cuda.device_count()),
        "collective_device": str(collective_device("nccl")),
    }
    # Host data through the helpers that used to hand CPU tensors to NCCL.
    out["shared"] = pipeline_passes.share_from_last_stage(torch.tensor([1.0, 2.0]), 2).tolist()
    out["summed"] = pipeline_passes.sum_over_data_parallel(torch.tensor([3.0])).tolist()
    out["gathered"] = pipeline_passes.all_gather_data_parallel({"a": torch.ones(2)})[0][
        "a"
    ].tolist()
    teardown_megatron()
    return out


def test_nccl_init_and_device_binding():
    out = run_on_ranks(_binding_body, 1, timeout_s=300)[0]
    assert out["backend"] == "nccl" and out["device"] == out["ordinal"] == 0
    assert out["collective_device"] == "cuda:0"
    assert out["shared"] == [1.0, 2.0] and out["summed"] == [3.0] and out["gathered"] == [1.0, 1.0]


def _bf16_body():
    from rlmega.megatron import offload
    from rlmega.megatron.lm_step import lm_forward_backward
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1)
    mm = _manager()
    tokens = _tokens()
    losses = []
    for _ in range(5):
        losses.append(lm_forward_backward(mm.model, tokens, micro_batch_size=2))
        mm.optimizer_step()
    out = {
        "losses": losses,
        "params": {(p.dtype, p.device.type) for p in offload.model_params(mm.model)},
        "main": {(p.dtype, p.device.type) for p in offload.main_params(mm.optimizer)},
        "grads": {g.dtype for g in offload.model_grads(mm.model)},
    }
    teardown_megatron()
    return out


def test_bf16_train_step_with_the_distributed_optimizer():
    out = run_on_ranks(_bf16_body, 1, timeout_s=600)[0]
    print("bf16 losses", out["losses"])
    assert (
        all(map(lambda x: x == x and abs(x) < 1e3, out["losses"]))
        and out["losses"][-1] < out["losses"][0]
    )
    assert out["params"] == {(torch.bfloat16, "cuda")}
    assert out["main"] == {(torch.float32, "cuda")}
    assert out["grads"] == {torch.float32}


def _offload_body():
    from rlmega.megatron import offload
    from rlmega.megatron.lm_step import lm_forward_backward
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1)
    mm = _manager()
    tokens = _tokens()
    lm_forward_backward(mm.model, tokens, micro_batch_size=2)
    mm.optimizer_step()  # Adam state exists now
    before = [p.detach().clone() for p in offload.model_params(mm.model)]
    eval_before = lm_forward_backward(mm.model, tokens, micro_batch_size=2, forward_only=True)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    cycles = []
    for _ in range(2):  # a second cycle shows whether each one leaks
        for f in (
            mm.offload_params,
            mm.offload_grads,
            mm.offload_optimizer_state,
            mm.offload_megatron_copy_params,
        ):
            f()
        torch.cuda.empty_cache()
        offloaded, free_offloaded = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        for f in (
            mm.onload_params,
            mm.onload_grads,
            mm.onload_optimizer_state,
            mm.load_megatron_copy_params,
        ):
            f()
        cycles.append((offloaded, torch.cuda.memory_allocated(), free_offloaded))
    storages = len(
        offload._distinct_storages(
            offload.model_params(mm.model)
            + offload.model_grads(mm.model)
            + offload.optimizer_state(mm.optimizer)
            + offload.main_params(mm.optimizer)
        )
    )
    same = all(torch.equal(a, b) for a, b in zip(before, offload.model_params(mm.model)))
    eval_after = lm_forward_backward(mm.model, tokens, micro_batch_size=2, forward_only=True)
    loss = lm_forward_backward(mm.model, tokens, micro_batch_size=2)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in offload.model_params(mm.model)
        + offload.optimizer_state(mm.optimizer)
        + offload.main_params(mm.optimizer)
    )
    teardown_megatron()
    return dict(
        resident=resident,
        offloaded=cycles[0][0],
        onloaded=cycles[0][1],
        onloaded_again=cycles[1][1],
        offloaded_again=cycles[1][0],
        free_offloaded=cycles[0][2],
        storages=storages,
        same=same,
        eval_before=eval_before,
        eval_after=eval_after,
        loss=loss,
        state_bytes=state_bytes,
    )


def test_offload_and_onload_free_and_restore_device_memory():
    m = run_on_ranks(_offload_body, 1, timeout_s=600)[0]
    print({k: (v / 2**20 if isinstance(v, int) else v) for k, v in m.items()}, "(MiB)")
    # Params, main params and Adam moments alone are this many bytes; offloading must free at least that.
    assert m["resident"] - m["offloaded"] >= m["state_bytes"]
    # Re-allocated storages may land in blocks the caching allocator rounds up (it keeps a remainder
    # under 1 MiB unsplit), so onloading may hold up to 1 MiB more per storage (measured on an H100:
    # +4 MiB over 10 storages); a second cycle must not grow it: nothing leaks per cycle.
    assert 0 <= m["onloaded"] - m["resident"] <= m["storages"] * 2**20
    assert m["onloaded_again"] == m["onloaded"] and m["offloaded_again"] == m["offloaded"]
    assert m["same"] and m["eval_after"] == m["eval_before"] and m["loss"] == m["loss"]


class _Sink:
    """Stands where a vLLM engine would receive the weights (vLLM on CUDA cannot run on this
    machine): keeps what arrived, on the host, as an engine's loader would read it."""

    def __init__(self):
        self.received = {}

    def receive_weights(self, bucket, version, sender):
        for name, t in bucket:
            self.received[name] = t.detach().to("cpu", copy=True)

    def finish_weights(self, version, sender):
        pass


def _colocated_body(path, cycle):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.sync.transports import DirectTransport
    from rlmega.testing.batches import random_batch
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=path, dtype="bfloat16"),
        ParallelismConfig(),
        OptimizerConfig(lr=3e-3),
        ActorConfig(max_tokens_per_micro_batch=40, offload_while_generating=cycle),
        AlgorithmConfig(kl_coef=0.0),
    )
    actor.setup(with_reference=False)
    batch = random_batch(10, seed=1)
    sink, metrics, phases = _Sink(), [], []
    for step in range(3):
        old = actor.compute_logprobs(batch)
        metrics.append(actor.train_step(dataclasses.replace(batch, old_logprobs=old)))
        # What Roles.rollout_phase does on colocated GPUs: release all but the params, sync, release
        # the params too while the engines generate, take everything back to train.
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        kept = actor.offload_for_rollout(keep_params=True)
        actor.sync_model_to_rollout(DirectTransport([sink]), version=step + 1)
        released = actor.offload_for_rollout()
        back = actor.onload_for_training()
        phases.append(
            dict(
                before=before,
                kept=kept["device_bytes"],
                released=released["device_bytes"],
                kinds=released["offloaded"],
                after=back["offloaded"],
            )
        )
    weights = {k: float(v.float().abs().sum()) for k, v in sink.received.items()}
    actor.teardown()
    return metrics, phases, weights


def test_colocated_phases_on_the_device_free_memory_and_train_bit_exactly(tmp_path):
    """The colocated trainer's release/sync/release/onload cycle on CUDA tensors, three steps."""
    from rlmega.demo.tiny_model import make_tiny_model

    path = str(
        make_tiny_model(
            tmp_path / "m", hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=5
        )
    )
    plain, _, w_plain = run_on_ranks(_colocated_body, 1, args=(path, False), timeout_s=600)[0]
    cycled, phases, w_cycled = run_on_ranks(_colocated_body, 1, args=(path, True), timeout_s=600)[0]
    print(phases)
    for ph in phases:
        assert (
            ph["kinds"] == ["grads", "main params", "optimizer state", "params"]
            and ph["after"] == []
        )
        assert ph["before"] > ph["kept"] > ph["released"]
    assert [json.dumps(m, sort_keys=True) for m in cycled] == [
        json.dumps(m, sort_keys=True) for m in plain
    ]
    assert w_cycled == w_plain and len(w_plain) > 0


def _rng_body(ckpt):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1, seed=7)
    mm = _manager()
    mm.save_checkpoint(ckpt, step=1)
    with get_cuda_rng_tracker().fork():
        expected_tracker = torch.rand(4, device="cuda")
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")  # move both generators on
    with get_cuda_rng_tracker().fork():
        torch.rand(100, device="cuda")
    mm.load_checkpoint(ckpt)
    with get_cuda_rng_tracker().fork():
        got_tracker = torch.rand(4, device="cuda")
    got = torch.rand(4, device="cuda")
    teardown_megatron()
    return expected.cpu(), got.cpu(), expected_tracker.cpu(), got_tracker.cpu()


def test_cuda_rng_state_round_trips_through_a_checkpoint(tmp_path):
    expected, got, expected_tracker, got_tracker = run_on_ranks(
        _rng_body, 1, args=(str(tmp_path / "ckpt"),), timeout_s=600
    )[0]
    assert torch.equal(expected, got) and torch.equal(expected_tracker, got_tracker)


def _mfu_body(out):
    spec = importlib.util.spec_from_file_location(
        "megatron_mfu", ROOT / "tools" / "bench" / "megatron_mfu.py"
    )
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    return mfu.main(["--steps", "5", "--warmup", "2", "--json", out])


def test_mfu_of_a_1b_shape(tmp_path):
    r = run_on_ranks(_mfu_body, 1, args=(str(tmp_path / "mfu.json"),), timeout_s=600)[0]
    print(json.dumps({k: v for k, v in r.items() if k != "losses"}, indent=1))
    assert 0 < r["mfu_vs_matmul_peak"] <= 1.0
    assert r["params"] > 1e9
