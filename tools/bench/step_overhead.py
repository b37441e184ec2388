"""Benchmark: the share of a GRPO step spent outside its work (generate, reward, log-probs, train, sync).

    python tools/bench/step_overhead.py                  # the issue-12 workload, 6 steps, ~2 min on 2 cores
    python tools/bench/step_overhead.py --steps 10 --json runs/bench/overhead.json
    python tools/bench/step_overhead.py --smoke          # a tiny model, 3 steps: about a minute; CI runs it

It runs ``rlmega train configs/bench_grpo_cpu.yaml`` (the workload of tools/bench/grpo_vs_trl.py: a random
21M-parameter Qwen2, 8 prompts x 8 samples, up to 128 new tokens, KL to a reference; the default layout)
and reads metrics.jsonl. Per step:

    overhead_s = time_step - (time_wait + time_logprob + time_train + time_sync)

(time_wait: the step waiting for its batch from the producer, i.e. generation and judging in the
synchronous loop; judging happens inside it, so there is no separate reward phase.)

what the driver does between the roles' work: decoding responses for the reward, building the
batch, advantages, splitting into optimizer steps, the train/rollout parity metric, Ray's call and
argument overhead around each phase. The first ``--warmup`` steps are left out. Printed: each step's
time_step and overhead, and the median overhead share (median of overhead_s / time_step) with the
issue's target (<= 5%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from grpo_vs_trl import SideFailed, run_rlmega  # noqa: E402  (the same rlmega side)

TARGET = 0.05


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out")
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 steps")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shape = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8)
    extra = []
    if args.smoke:  # head_dim 64: vLLM's CPU attention needs it
        shape, args.steps, extra = (
            dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2),
            3,
            ["rollout.max_response_tokens=16"],
        )
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    from rlmega.demo.tiny_model import make_tiny_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlmega-overhead-") as tmp:
        work = Path(tmp)
        make_tiny_model(work / "model", seed=0, **shape)
        try:
            run = run_rlmega(
                SimpleNamespace(steps=args.steps, timeout=args.timeout),
                [f"model.path={work / 'model'}", *extra],
                work,
                0,
            )
        except SideFailed as e:
            print(f"step_overhead: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    rows = []
    for s in run["steps"]:
        work_s = s["time_wait"] + sum(
            s.get(f"time_{ph}", 0.0) for ph in ("logprob", "train", "sync")
        )
        rows.append(
            {
                "step": s["step"],
                "time_step": s["time_step"],
                "work_s": work_s,
                "overhead_s": s["time_step"] - work_s,
                "share": (s["time_step"] - work_s) / s["time_step"],
            }
        )
    measured = rows[args.warmup :]
    share = statistics.median(r["share"] for r in measured)
    verdict = "PASS" if share <= TARGET else "MISS"
    for r in rows:
        print(
            f"step {r['step']}: time_step {r['time_step']:.3f} s, overhead {r['overhead_s']:.3f} s "
            f"({100 * r['share']:.2f}%){'  (warm-up)' if r in rows[: args.warmup] else ''}"
        )
    print(
        f"median overhead share {100 * share:.2f}% of a step  (target <= {100 * TARGET:.0f}%: {verdict})  "
        f"[{time.perf_counter() - t0:.0f} s in all]"
    )
    res = {
        "model": shape,
        "steps": rows,
        "warmup": args.warmup,
        "median_share": share,
        "target": TARGET,
        "verdict": verdict,
        "smoke": args.smoke,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(res, indent=1))
        path.with_suffix(".tmp").replace(path)
    return res


if __name__ == "__main__":
    main()
