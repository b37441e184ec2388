"""Benchmark: what a long trace costs the learner, the whole-logits head against chunked log-probs (issue 40).

    python tools/bench/long_context.py                  # Megatron, 2k-32k tokens, 151,936 vocabulary (CPU)
    python tools/bench/long_context.py --backend fsdp   # the same on the FSDP learner
    python tools/bench/long_context.py --smoke          # seconds: 512 tokens, both heads, one timing round (CI)
    python tools/bench/long_context.py --json runs/bench/long_context.json

One micro-batch holds one sample: a 64-token prompt and a response filling the rest of the length,
over a tiny model (hidden 64, 2 layers) with Qwen's real 151,936-token vocabulary, so the head is what
grows. Measured per length and head, each in a fresh process (a process's peak resident memory only
ever grows):

- **memory**: the peak resident memory of one train pass (``engine.forward_backward`` with an RL-style
  loss of log-probs and entropy) above what the process held just before it. The kernel's own high-water
  mark (VmHWM) is reset first (``/proc/self/clear_refs``), and glibc returns large blocks at once
  (MALLOC_MMAP_THRESHOLD_), so the number is the pass's own peak. On a GPU, torch.cuda's peak instead.
- **tokens/s** at ``--speed-tokens`` (2k): both heads in one process on the same weights, alternated
  ``--rounds`` times (these machines are noisy), forward + backward; the ratio is chunked / whole.

The whole-logits head needs ~3 float32 copies of tokens x vocabulary (10 GB each at 16k tokens): past
``--max-whole-tokens`` it does not fit a 24 GB machine, and its memory is extrapolated linearly from the
two longest lengths measured (it is linear: every copy is tokens x vocabulary), marked as such.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
PROMPT = 64
SHAPE = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    model_type="qwen2",
)


def _world_of_one() -> None:
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
    ).items():
        os.environ.setdefault(k, v)


def _engine(backend: str, tokens: int):
    """A built engine (world 1) for micro-batches of ``tokens`` tokens."""
    from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig, ParallelismConfig

    _world_of_one()
    if backend == "megatron":
        from rlmega.megatron.engine import MegatronEngine as cls
    else:
        from rlmega.fsdp.engine import FSDPEngine as cls
    parallel = ParallelismConfig()
    cls.init_process(parallel, seed=1)
    hf = dict(SHAPE, max_position_embeddings=max(tokens, 512))
    engine = cls(
        ModelConfig(path=""),
        parallel,
        OptimizerConfig(lr=1e-5),
        ActorConfig(max_tokens_per_micro_batch=tokens),
        hf_config=hf,
    )
    engine.build()
    return engine


def _micro_batches(engine, tokens: int) -> list[dict]:
    from rlmega.testing.batches import random_batch

    batch = random_batch(
        1,
        vocab=VOCAB,
        seed=7,
        prompt_len=(PROMPT, PROMPT + 1),
        response_len=(tokens - PROMPT, tokens - PROMPT + 1),
    )
    return engine.micro_batches(engine.shard(batch))


def _loss(fields, lp, ent):
    mask = fields["loss_mask"]
    return ((lp * fields["advantages"] + 0.01 * ent) * mask).sum(), mask.sum(), {}


def _train_pass(engine, mbs) -> None:
    from rlmega.learner.engine_api import Head

    engine.zero_grad()
    engine.forward_backward(mbs, Head(temperature=1.0, entropy=True, entropy_grad=True), _loss)


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _pass_peak(engine, mbs) -> int:
    """The peak bytes one train pass adds to what the process held just before it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _train_pass(engine, mbs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _vm_rss_bytes()
    _train_pass(engine, mbs)
    return _vm_hwm_bytes() - before


def measure(backend: str, tokens: int, memory: list[int], speed: list[int], rounds: int) -> dict:
    """(In its own process.) Peak bytes of a train pass for each chunk size in ``memory`` (0: the whole
    logits), then tokens/s of each chunk size in ``speed``, alternated ``rounds`` times on the same weights."""
    engine = _engine(backend, tokens)
    mbs = _micro_batches(engine, tokens)
    out = {"peak_bytes": {}, "speed": {}}
    for chunk in memory:
        engine.chunk_tokens = chunk
        # once first: the gradients' buffers exist before the pass measured
        _train_pass(engine, mbs)
        out["peak_bytes"][str(chunk)] = _pass_peak(engine, mbs)
    times = {c: [] for c in speed}
    for _ in range(rounds):
        for c in speed:
            engine.chunk_tokens = c
            start = time.perf_counter()
            _train_pass(engine, mbs)
            times[c].append(time.perf_counter() - start)
    for c, t in times.items():
        median = sorted(t)[len(t) // 2]
        out["speed"][str(c)] = {"median_s": median, "tokens_per_s": tokens / median}
    return out


def _in_process(args: dict, low_mmap: bool) -> dict:
    """``measure(**args)`` in a fresh interpreter (its own peak memory); its answer. ``low_mmap``: glibc
    maps every block over 64 KiB on its own and unmaps it when freed, so resident memory follows the
    tensors alive (for memory; it costs system time, so timings run without it)."""
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)
    if low_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["megatron", "fsdp"], default="megatron")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument(
        "--chunk", type=int, default=2048, help="actor.logprob_chunk_tokens of the chunked head"
    )
    ap.add_argument(
        "--max-whole-tokens",
        type=int,
        default=4096,
        help="longest length the whole-logits head is run at (beyond: extrapolated)",
    )
    ap.add_argument("--speed-tokens", type=int, default=2048)
    ap.add_argument(
        "--speed-chunks",
        type=int,
        nargs="+",
        default=[512],
        help="chunk sizes timed besides --chunk (smaller: more chunks recomputed)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--smoke", action="store_true", help="512 tokens, both heads, one round: seconds"
    )
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(**json.loads(a.child))))
        return {}
    speed_chunks = [0, a.chunk, *a.speed_chunks]
    if a.smoke:  # one process: both heads' memory at 512 tokens, then one timing round of each
        a.lengths, a.max_whole_tokens, a.speed_tokens, a.rounds, a.chunk = [512], 512, 512, 1, 128
        speed_chunks = [0, a.chunk]
    rows, whole, speed = [], {}, None
    for n in sorted(a.lengths):
        heads = [0, a.chunk] if n <= a.max_whole_tokens else [a.chunk]
        timed = speed_chunks if a.smoke else []
        got = _in_process(
            {
                "backend": a.backend,
                "tokens": n,
                "memory": heads,
                "speed": timed,
                "rounds": a.rounds,
            },
            low_mmap=True,
        )
        speed = got["speed"] or speed
        chunked = got["peak_bytes"][str(a.chunk)]
        if "0" in got["peak_bytes"]:
            whole[n] = got["peak_bytes"]["0"]
        rows.append({"tokens": n, "chunked_bytes": chunked, "whole_bytes": whole.get(n)})
    # past --max-whole-tokens the whole head is extrapolated on the line through its two longest lengths
    # (exactly linear: every copy it makes is tokens x vocabulary); with one length, not at all
    line = sorted(whole.items())[-2:]
    per_token = (line[1][1] - line[0][1]) / (line[1][0] - line[0][0]) if len(line) == 2 else None
    for r in rows:
        r["whole_extrapolated"] = r["whole_bytes"] is None
        if r["whole_extrapolated"] and per_token is not None:
            r["whole_bytes"] = line[1][1] + per_token * (r["tokens"] - line[1][0])
        r["ratio"] = r["chunked_bytes"] / r["whole_bytes"] if r["whole_bytes"] else None
        whole_text = (
            "-"
            if r["whole_bytes"] is None
            else f"{_gib(r['whole_bytes'])} GiB{' (extrapolated)' if r['whole_extrapolated'] else ''}"
        )
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(
            f"{r['tokens']} tokens: whole {whole_text}, chunked ({a.chunk}) {_gib(r['chunked_bytes'])} GiB, "
            f"ratio {ratio}",
            flush=True,
        )
    if not a.smoke:
        speed = _in_process(
            {
                "backend": a.backend,
                "tokens": a.speed_tokens,
                "memory": [],
                "speed": speed_chunks,
                "rounds": a.rounds,
            },
            low_mmap=False,
        )["speed"]
    base = speed["0"]["tokens_per_s"]
    for s in speed.values():
        s["ratio"] = s["tokens_per_s"] / base
    print(
        f"tokens/s at {a.speed_tokens} tokens (train pass, median of {a.rounds}): "
        + ", ".join(
            f"{'whole' if c == '0' else 'chunk ' + c} {s['tokens_per_s']:.0f} ({s['ratio']:.2f})"
            for c, s in speed.items()
        ),
        flush=True,
    )
    result = {
        "backend": a.backend,
        "vocab": VOCAB,
        "shape": SHAPE,
        "chunk": a.chunk,
        "memory": rows,
        "whole_bytes_per_token": per_token,
        "speed_tokens": a.speed_tokens,
        "speed": speed,
    }
    if a.json:
        write_json(a.json, result)
    return result


def write_json(path: str, result: dict) -> None:
    """``result`` as JSON at ``path``, written then renamed (never half-written)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    main()
