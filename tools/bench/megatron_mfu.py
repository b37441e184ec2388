"""Benchmark: model FLOPs utilisation (MFU) of a train step through MegatronModelManager or FSDPModelManager.

    python tools/bench/megatron_mfu.py                    # GPU: ~1.2B Llama-3.2-1B shape, bf16, world size 1
    python tools/bench/megatron_mfu.py --smoke            # CPU or GPU: tiny float32 shape, a few seconds
    python tools/bench/megatron_mfu.py --json runs/bench/mfu.json --seq-len 4096 --micro-batch 1
    python tools/bench/megatron_mfu.py --backend fsdp     # the same shape, data and formula on actor.backend=fsdp
    python tools/bench/megatron_mfu.py --profile runs/bench/mfu_kernels.txt   # + one profiled step: where it goes

The model is built from an HF config dict in code (``MegatronModelManager(hf_config=...)``, random
init, no weights), wrapped as training wraps it (Float16Module for bf16, Megatron DDP, the distributed
optimizer), and trained on random tokens with ``lm_forward_backward`` + ``optimizer_step``: the same
machinery as the RL learner, with the plain next-token loss. Steps after ``--warmup`` are timed.

``--backend fsdp`` builds the same HF config as ``FSDPModelManager(hf_config=...)`` (the transformers
model with SDPA attention, ``fully_shard`` per decoder layer and at the root over a one-rank mesh,
bf16 compute through ``MixedPrecisionPolicy`` with fp32 master weights, AdamW) and times the same
steps: per micro-batch ``before_micro_batch`` + forward + the fp32 token-mean cross entropy of the
logits + backward, then ``optimizer_step`` (clip + AdamW). Same tokens, same FLOPs formula, same peak.

Model FLOPs per token (the PaLM appendix-B convention, also nanoGPT's ``estimate_mfu``)::

    6 * N  +  12 * L * S * (heads * head_dim)

* ``N``: parameters that multiply activations: every transformer-layer weight (attention, MLP,
  norms) plus the output head (hidden x vocab). The input embedding table is a lookup and is not
  counted; with tied embeddings the shared matrix is counted once, as the head.
* ``6``: 2 FLOPs per multiply-add, forward (1x) + backward (2x: grads of inputs and of weights).
* ``12 * L * S * d_attn``: attention scores QK^T and the weighted sum AV, each 2 * S * d_attn per token
  per layer, times 3 for forward + backward. Causal masking is not discounted (the convention; the
  kernels here compute the full square). Optimizer, norms' elementwise work, softmax: not counted.

MFU = achieved model FLOP/s / peak. The peak is measured in the same run: the best of
``--peak-repeats`` square matmuls (bf16 on GPU; float32 in --smoke) of size ``--peak-n``, 2 n^3 FLOPs
each. On an H100/H200 it is also quoted against the datasheet's dense bf16 peak (989.4 TFLOP/s, SXM).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

# NVIDIA H100/H200 SXM, dense (no sparsity)
DATASHEET_BF16_DENSE = {"H100": 989.4e12, "H200": 989.4e12}

# Llama-3.2-1B's published shape (1.24B parameters, tied embeddings), no weights needed.
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=16,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=True,
    head_dim=64,
)
TINY = dict(
    LLAMA_1B,
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
    head_dim=32,
    tie_word_embeddings=False,
)


def counted_params(hf: dict) -> int:
    """N of the FLOPs formula: layer weights, final norm and output head (no input embedding)."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv = (
        hf["num_attention_heads"],
        hf.get("num_key_value_heads") or hf["num_attention_heads"],
    )
    head_dim = hf.get("head_dim") or h // heads
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h  # q, k, v, o
    if hf.get("architectures", [""])[0] == "Qwen2ForCausalLM":
        attn += heads * head_dim + 2 * kv * head_dim  # q, k, v biases
    # + gate, up, down; two RMSNorm weights
    per_layer = attn + 3 * h * hf["intermediate_size"] + 2 * h
    return layers * per_layer + h + vocab * h


def model_flops_per_token(hf: dict, seq_len: int) -> float:
    """Training FLOPs per token of a Llama/Qwen2-style decoder (see the module docstring)."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return 6.0 * counted_params(hf) + 12.0 * hf["num_hidden_layers"] * seq_len * heads * head_dim


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int, repeats: int) -> float:
    """Best FLOP/s of an n x n x n matmul on this device (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        _sync(device)
        if i:  # the first round warms up (kernel selection, clocks)
            best = min(best, (time.perf_counter() - start) / 5)
    return 2.0 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _world_of_one() -> None:
    """torch.distributed's environment for a single rank, unless a launcher set it."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_PORT=str(port))
    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
    ).items():
        os.environ.setdefault(k, v)


def _timed(step, steps: int, warmup: int, dev: torch.device, profile: str) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones; then, with
    ``profile``, one more call under torch.profiler, its ops by self time on the device (CPU time
    on a CPU) written to that file: where the step goes, for the next speed-up."""
    times = []
    for i in range(warmup + steps):
        _sync(dev)
        start = time.perf_counter()
        step()
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        cuda = dev.type == "cuda"
        with profiler(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        ) as prof:
            step()
            _sync(dev)
        table = prof.key_averages().table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
            row_limit=40,
            max_name_column_width=90,
        )
        Path(profile).parent.mkdir(parents=True, exist_ok=True)
        Path(profile).write_text(f"one step, {dev}\n{table}\n")
    return times


def _megatron_steps(
    hf: dict,
    dtype: str,
    tokens: torch.Tensor,
    micro_batch: int,
    steps: int,
    warmup: int,
    profile: str = "",
):
    """(parameters, step times after the warm-up, losses, device) of Megatron LM steps on ``tokens``."""
    from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.lm_step import lm_forward_backward
    from rlmega.megatron.model_manager import MegatronModelManager
    from rlmega.megatron.runtime import device, init_megatron, teardown_megatron

    init_megatron(1, 1, None, seed=1234)
    try:
        dev = device()
        tokens = tokens.to(dev)
        mm = MegatronModelManager(
            ModelConfig(path="", dtype=dtype),
            ParallelismConfig(),
            OptimizerConfig(lr=1e-5, use_distributed_optimizer=True),
            hf_config=hf,
        )
        mm.setup_model_and_optimizer(load_weights=False)
        params = sum(p.numel() for c in mm.unwrapped() for p in c.parameters())
        losses = []

        def step(mm):
            losses.append(lm_forward_backward(mm.model, tokens, micro_batch))
            mm.optimizer_step()

        # mm goes in as an argument, not as a free variable of step: `del mm` below (the model freed
        # before teardown) would leave a closure over it pointing at nothing.
        times = _timed(functools.partial(step, mm), steps, warmup, dev, profile)
        del mm
    finally:
        teardown_megatron()
    return params, times, losses, dev


def fsdp_config(hf: dict) -> dict:
    """``hf`` as FSDPModelManager's ``hf_config`` (it names the architecture by ``model_type``)."""
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[hf["architectures"][0]]
    return {**hf, "model_type": model_type}


def _fsdp_steps(
    hf: dict,
    dtype: str,
    tokens: torch.Tensor,
    micro_batch: int,
    steps: int,
    warmup: int,
    profile: str = "",
):
    """(parameters, step times after the warm-up, losses, device) of FSDP2 LM steps on ``tokens``."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig
    from rlmega.fsdp.model_manager import FSDPModelManager
    from rlmega.process.distributed import init_distributed

    init_distributed()
    try:
        torch.manual_seed(1234)
        mm = FSDPModelManager(
            ModelConfig(path="", dtype=dtype, seed=1234),
            OptimizerConfig(lr=1e-5),
            ActorConfig(),
            world_size=1,
            rank=0,
            hf_config=fsdp_config(hf),
        )
        mm.setup_model_and_optimizer()
        dev = mm.device
        tokens = tokens.to(dev)
        params = sum(p.numel() for p in mm.model.parameters())
        chunks = tokens.split(micro_batch)
        losses = []

        def step(mm):
            total = 0.0
            for k, chunk in enumerate(chunks):
                mm.before_micro_batch(mm.model, is_last_micro_batch=k == len(chunks) - 1)
                # (b, t, V), bf16
                logits = mm.model(input_ids=chunk[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()) / len(
                    chunks
                )
                loss.backward()
                total += loss.detach()
            mm.optimizer_step()
            losses.append(float(total))

        times = _timed(functools.partial(step, mm), steps, warmup, dev, profile)  # as above
        del mm
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return params, times, losses, dev


def run(
    hf: dict,
    dtype: str,
    seq_len: int,
    micro_batch: int,
    micro_batches: int,
    steps: int,
    warmup: int,
    peak_n: int,
    peak_repeats: int,
    backend: str = "megatron",
    profile: str = "",
) -> dict:
    _world_of_one()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, hf["vocab_size"], (micro_batch * micro_batches, seq_len + 1), generator=g
    )
    steps_fn = {"megatron": _megatron_steps, "fsdp": _fsdp_steps}[backend]
    params, times, losses, dev = steps_fn(hf, dtype, tokens, micro_batch, steps, warmup, profile)
    peak_mem = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    step_s = sorted(times)[len(times) // 2]  # median
    tokens_per_step = micro_batch * micro_batches * seq_len
    achieved = model_flops_per_token(hf, seq_len) * tokens_per_step / step_s
    peak_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    peak = matmul_peak(peak_dtype, dev, peak_n, peak_repeats)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    datasheet = (
        next((v for k, v in DATASHEET_BF16_DENSE.items() if k in name), None)
        if dtype == "bfloat16"
        else None
    )
    return {
        "backend": backend,
        "device": name,
        "dtype": dtype,
        "params": params,
        "seq_len": seq_len,
        "tokens_per_step": tokens_per_step,
        "step_s_median": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "losses": losses,
        "counted_params": counted_params(hf),
        "model_flops_per_token": model_flops_per_token(hf, seq_len),
        "achieved_tflops": achieved / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "mfu_vs_matmul_peak": achieved / peak,
        "datasheet_tflops": datasheet / 1e12 if datasheet else None,
        "mfu_vs_datasheet": achieved / datasheet if datasheet else None,
        "peak_memory_gib": peak_mem / 2**30,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny float32 shape, seconds, runs on CPU")
    ap.add_argument(
        "--backend",
        choices=("megatron", "fsdp"),
        default="megatron",
        help="the learner (actor.backend)",
    )
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument(
        "--micro-batches", type=int, default=None, help="micro-batches per optimizer step"
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--peak-n", type=int, default=None, help="matmul size of the peak measurement")
    ap.add_argument("--peak-repeats", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument(
        "--profile", default="", help="profile one more step; its op table (by self time) goes here"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        hf, dtype, d = (
            TINY,
            "float32",
            dict(seq_len=64, micro_batch=2, micro_batches=2, steps=3, warmup=1, peak_n=256),
        )
    else:
        if not torch.cuda.is_available():
            ap.error("the full benchmark needs a CUDA GPU; use --smoke on a CPU")
        hf, dtype, d = (
            LLAMA_1B,
            "bfloat16",
            dict(seq_len=2048, micro_batch=2, micro_batches=4, steps=10, warmup=3, peak_n=8192),
        )
    for k in d:
        if getattr(a, k) is not None:
            d[k] = getattr(a, k)
    result = run(
        hf,
        dtype,
        d["seq_len"],
        d["micro_batch"],
        d["micro_batches"],
        d["steps"],
        d["warmup"],
        d["peak_n"],
        a.peak_repeats,
        a.backend,
        a.profile,
    )
    print(
        f"{a.backend} on {result['device']} {dtype}: {result['params'] / 1e6:.1f}M params, "
        f"{result['tokens_per_s']:.0f} tokens/s, "
        f"{result['achieved_tflops']:.3g} TFLOP/s model; matmul peak {result['matmul_peak_tflops']:.3g} TFLOP/s "
        f"-> MFU {100 * result['mfu_vs_matmul_peak']:.1f}%"
        + (
            f"; datasheet {result['datasheet_tflops']:.1f} -> MFU {100 * result['mfu_vs_datasheet']:.1f}%"
            if result["datasheet_tflops"]
            else ""
        )
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    # the checkout's rlmega, when run by path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
