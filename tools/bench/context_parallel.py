"""Benchmark: a train pass's memory per rank at context parallelism 1 and 2, and at TP2 with sequence
parallelism (issue 40).

    python tools/bench/context_parallel.py                    # 4k-16k tokens, CP1 / CP2 / TP2+SP (CPU)
    python tools/bench/context_parallel.py --smoke            # seconds: 512 tokens at CP2 (CI)
    python tools/bench/context_parallel.py --json runs/bench/context_parallel.json

One micro-batch of one sample (a 64-token prompt, the response filling the rest of the length) over a small
Qwen2 shape whose activations are what grows (hidden 256, 4 layers, 4 heads, 2 KV heads) with Qwen's real
151,936-token vocabulary, chunked log-probs (``--chunk`` tokens a chunk: the head's floor). Each layout runs
in fresh processes, one per rank (run_on_ranks); each rank reports the peak resident memory of one train
pass (``engine.forward_backward``: log-probs, entropy with its gradient, backward) above what it held just
before, the kernel's high-water mark reset first (as tools/bench/long_context.py measures; glibc maps large
blocks on their own, so resident memory follows the tensors alive). The table gives the largest rank's,
and the ratio to CP1 at the same length: what a rank needs, so what decides whether a length fits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))
from long_context import write_json  # noqa: E402

VOCAB = 151_936
PROMPT = 64
SHAPE = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    intermediate_size=512,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    model_type="qwen2",
)
LAYOUTS = {"cp1": (1, 1), "cp2": (1, 2), "tp2_sp": (2, 1)}  # name: (TP, CP); world = TP x CP


def _rank_peak(tokens: int, tp: int, cp: int, chunk: int) -> dict:
    """(On each rank.) The peak bytes of one train pass above what the rank held before it, and its seconds."""
    import time

    from long_context import _micro_batches, _pass_peak, _train_pass

    from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.engine import MegatronEngine

    parallel = ParallelismConfig(
        tensor_model_parallel_size=tp, world_size=tp * cp, context_parallel_size=cp
    )
    MegatronEngine.init_process(parallel, seed=1)
    engine = MegatronEngine(
        ModelConfig(path=""),
        parallel,
        OptimizerConfig(lr=1e-5),
        ActorConfig(max_tokens_per_micro_batch=tokens, logprob_chunk_tokens=chunk),
        hf_config=dict(SHAPE, max_position_embeddings=max(tokens, 512)),
    )
    engine.build()
    mbs = _micro_batches(engine, tokens)
    _train_pass(engine, mbs)  # once first: the gradients' buffers exist before the pass measured
    start = time.perf_counter()
    peak = _pass_peak(engine, mbs)
    return {
        "peak_bytes": peak,
        "seconds": time.perf_counter() - start,
        "local_tokens": int(mbs[0]["tokens"].shape[1]),
    }


def measure(tokens: int, layout: str, chunk: int) -> dict:
    from rlmega.testing.multiproc import run_on_ranks

    tp, cp = LAYOUTS[layout]
    ranks = run_on_ranks(
        _rank_peak,
        tp * cp,
        args=(tokens, tp, cp, chunk),
        timeout_s=3600,
        env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
    )
    return {
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "seconds": max(r["seconds"] for r in ranks),
        "local_tokens": max(r["local_tokens"] for r in ranks),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--chunk", type=int, default=512, help="actor.logprob_chunk_tokens")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="512 tokens at CP2 (CP1 is long_context.py's path): seconds",
    )
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args(argv)
    if a.smoke:
        a.lengths, a.layouts, a.chunk = [512], ["cp2"], 128
    rows = []
    for n in a.lengths:
        row = {"tokens": n}
        for name in a.layouts:
            row[name] = measure(n, name, a.chunk)
        base = row.get("cp1", {}).get("peak_bytes")
        for name in a.layouts:
            row[name]["ratio"] = row[name]["peak_bytes"] / base if base else None
        rows.append(row)
        print(
            f"{n} tokens: "
            + ", ".join(
                f"{name} {row[name]['peak_bytes'] / 2**30:.2f} GiB a rank"
                + (f" ({row[name]['ratio']:.2f} of cp1)" if row[name]["ratio"] is not None else "")
                + f", {row[name]['seconds']:.1f} s"
                for name in a.layouts
            ),
            flush=True,
        )
    result = {"vocab": VOCAB, "shape": SHAPE, "chunk": a.chunk, "rows": rows}
    if a.json:
        write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
