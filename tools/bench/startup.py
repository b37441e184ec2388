"""Benchmark: how long `rlmega train` takes to its first RL step, phase by phase, against an earlier commit.

    python tools/bench/startup.py                      # 4 cases x 2 rounds, this checkout vs --base: ~15 min
    python tools/bench/startup.py --cases world1 --rounds 3 --json runs/bench/startup.json
    python tools/bench/startup.py --smoke              # world 1, one step, one engine start, this checkout only
    python tools/bench/startup.py --cases '' --engine-starts 50   # 50 engine starts, failures counted: ~11 min

Each case is configs/tiny_cpu.yaml on the demo's tiny Qwen2 (made once here), 4 GRPO steps, no warm start and
no baseline eval, so that nothing but start-up comes before step 1:

    world1   one Megatron rank, one engine
    tp2pp2   Megatron TP2 x PP2 (the config's own layout)
    fsdp     the FSDP2 learner, one rank
    lora     LoRA rank 8 served unmerged, one Megatron rank

Measured from outside, as a user waits: ``first_step_s`` from launching the command to the first row in
metrics.jsonl, ``run_s`` to its exit. This checkout's runs also report their phases (RUN_DIR/setup.json,
rlmega/rundir/startup.py). The other side is ``--base`` (default: 8231bfb, the commit before issue 55's
work), checked out once into a git worktree under runs/bench/ and run from there with the same Python; each
round runs every case on both sides, alternating which goes first. Also printed: the floor, one
``python -c 'import torch, vllm, megatron.core, ray'`` per round on the same machine.

``--engine-starts N``: N engines started one after another, each in a fresh Ray actor made as `rlmega train`
makes them (rlmega/launch/engines.py), each asked for one generation and shut down: the failures are counted
and named, not raised, so that a rare start-up failure shows as a rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = "8231bfb"  # the commit before issue 55: sequential start-up
CASES = {
    "world1": [
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
    ],
    "tp2pp2": [],
    "fsdp": [
        "actor.backend=fsdp",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
    ],
    "lora": [
        "actor.lora.rank=8",
        "actor.lora.alpha=16",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
    ],
}
# The targets for time to the first step (seconds, this 2-core machine) and for a whole run's ratio.
TARGETS = {"world1": 11.0, "tp2pp2": 15.0}
RUN_RATIO_TARGET = 2.0
FLOOR_IMPORTS = "import torch, vllm, megatron.core, ray"


def floor_s(python: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", FLOOR_IMPORTS], check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t0


def base_checkout(rev: str) -> Path:
    """A worktree of ``rev`` under runs/bench/ (made once; the same commit is reused)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = ROOT / "runs" / "bench" / f"startup-base-{sha}"
    if not (path / "rlmega").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), sha],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return path


def run_once(
    code: Path, model: Path, run_dir: Path, case: str, steps: int, python: str, timeout: float
) -> dict:
    """One `rlmega train` of ``case`` from the checkout at ``code``: first_step_s, run_s and, where it wrote one,
    its setup.json."""
    cmd = [
        python,
        "-m",
        "rlmega.cli",
        "train",
        str(code / "configs/tiny_cpu.yaml"),
        f"model.path={model}",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.warmup_sft_steps=0",
        "trainer.eval_every=0",
        "trainer.resume=none",
        "trainer.save_every=0",
        *CASES[case],
    ]
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONWARNINGS": "ignore"}
    metrics = run_dir / "metrics.jsonl"
    log = run_dir.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT)
        first = None
        while proc.poll() is None:
            if first is None and metrics.is_file() and metrics.stat().st_size:
                first = time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                raise RuntimeError(f"{case} from {code} ran past {timeout:.0f}s: {log}")
            time.sleep(0.05)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{case} from {code} exited {proc.returncode}: {log.read_text()[-3000:]}"
        )
    if first is None:  # the last step and the exit came between two polls
        first = total
    setup = run_dir / "setup.json"
    return {
        "first_step_s": first,
        "run_s": total,
        "setup": json.loads(setup.read_text()) if setup.is_file() else None,
    }


def engine_starts(model: Path, n: int, timeout: float) -> dict:
    """``n`` engine starts in fresh Ray actors (this checkout): seconds of each start + generate + shutdown,
    and each failure's index and error."""
    import ray

    from rlmega.launch.engines import ENGINE_CONTROL_CONCURRENCY, engine_actor_class

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Engine, seconds, failures = engine_actor_class(), [], []
        for i in range(n):
            t0 = time.perf_counter()
            actor = Engine.options(max_concurrency=ENGINE_CONTROL_CONCURRENCY, num_cpus=1).remote(
                str(model),
                device="cpu",
                dtype="float32",
                max_model_len=96,
                seed=i,
                kv_cache_space_gb=0.25,
            )
            try:
                samples = ray.get(
                    actor.generate.remote([[1, 5, 7, 9]], n=2, max_tokens=8, seed=1),
                    timeout=timeout,
                )
                if len(samples) != 2 or not all(s.response_ids for s in samples):
                    raise RuntimeError(f"generate gave {samples!r}")
                ray.get(actor.shutdown.remote(), timeout=timeout)
                seconds.append(time.perf_counter() - t0)
            except Exception as exc:  # counted, not raised: the rate is the result
                failures.append({"start": i, "error": repr(exc)[-2000:]})
            finally:
                ray.kill(actor)
            print(
                f"engine start {i}: {time.perf_counter() - t0:.1f} s, {len(failures)} failed so far",
                flush=True,
            )
    finally:
        ray.shutdown()
    return {"starts": n, "failures": failures, "seconds": seconds, "median_s": median(seconds)}


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def report(res: dict) -> None:
    print(
        f"\nfloor ({FLOOR_IMPORTS}): median {res['floor_s']:.1f} s over {len(res['floors'])} runs"
    )
    sides = ["new"] + (["base"] if res["base"] else [])
    print(
        f"{'case':8} "
        + " ".join(f"{s + ' first step':>16} {s + ' run':>10}" for s in sides)
        + ("   first-step ratio  run ratio (base / new)" if res["base"] else "")
    )
    for case, c in res["cases"].items():
        line = f"{case:8} " + " ".join(
            f"{c[s]['first_step_s']:>14.1f} s {c[s]['run_s']:>8.1f} s" for s in sides
        )
        if res["base"]:
            line += f"   {c['first_step_ratio']:>16.2f}  {c['run_ratio']:>9.2f}"
        target = TARGETS.get(case)
        if target:
            line += f"   (first step <= {target:.0f} s: {'PASS' if c['new']['first_step_s'] <= target else 'MISS'})"
        print(line)
    for case, c in res["cases"].items():
        phases = c["new"]["phases"]
        if phases:
            print(
                f"{case} phases (median s, from -> to): "
                + ", ".join(
                    f"{p} {v['seconds']:.1f} ({v['start_s']:.1f} -> {v['end_s']:.1f})"
                    for p, v in phases.items()
                )
            )
    starts = res.get("engine_starts")
    if starts:
        print(
            f"engine starts in fresh Ray actors: {starts['starts']}, failed {len(starts['failures'])}; "
            f"start + generate + shutdown median {starts['median_s'] or 0:.1f} s"
        )
        for f in starts["failures"]:
            print(f"  start {f['start']} failed: {f['error'][-500:]}")
    if res["base"] and res["cases"]:
        ratios = [c["run_ratio"] for c in res["cases"].values()]
        print(
            f"whole-run ratio base / new: {', '.join(f'{r:.2f}' for r in ratios)} "
            f"(target >= {RUN_RATIO_TARGET}: {'PASS' if min(ratios) >= RUN_RATIO_TARGET else 'MISS'})"
        )


def summarize(runs: list[dict]) -> dict:
    out = {
        "first_step_s": median([r["first_step_s"] for r in runs]),
        "run_s": median([r["run_s"] for r in runs]),
        "runs": runs,
        "phases": {},
    }
    names = [p["phase"] for p in (runs[0]["setup"] or {}).get("phases", [])]
    for name in names:
        rows = [p for r in runs if r["setup"] for p in r["setup"]["phases"] if p["phase"] == name]
        out["phases"][name] = {
            k: median([p[k] for p in rows]) for k in ("seconds", "start_s", "end_s")
        }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run")
    p.add_argument(
        "--base", default=BASE, help="the commit to compare with; '' for this checkout only"
    )
    p.add_argument(
        "--engine-starts",
        type=int,
        default=0,
        help="engine starts in fresh Ray actors, failures counted",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="world1, one round, one step, no base, one engine start",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.cases, args.rounds, args.steps, args.base, args.engine_starts = "world1", 1, 1, "", 1
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    sys.path.insert(0, str(ROOT))
    from rlmega.cli import DEMO_MODEL
    from rlmega.demo.tiny_model import make_tiny_model

    python = sys.executable
    sides = {"new": ROOT, **({"base": base_checkout(args.base)} if args.base and cases else {})}
    runs: dict = {c: {s: [] for s in sides} for c in cases}
    floors = []
    with tempfile.TemporaryDirectory(prefix="rlmega-startup-") as tmp:
        work = Path(tmp)
        make_tiny_model(work / "model", **DEMO_MODEL, max_position_embeddings=512, overwrite=True)
        for rnd in range(args.rounds):
            floors.append(floor_s(python))
            for i, case in enumerate(cases):
                # who goes first alternates
                order = list(sides) if (rnd + i) % 2 == 0 else list(sides)[::-1]
                for side in order:
                    r = run_once(
                        sides[side],
                        work / "model",
                        work / f"{case}-{side}-{rnd}",
                        case,
                        args.steps,
                        python,
                        args.timeout,
                    )
                    runs[case][side].append(r)
                    print(
                        f"round {rnd} {case} {side}: first step {r['first_step_s']:.1f} s, run {r['run_s']:.1f} s",
                        flush=True,
                    )
        starts = (
            engine_starts(work / "model", args.engine_starts, args.timeout)
            if args.engine_starts
            else None
        )
    res = {
        "base": args.base,
        "steps": args.steps,
        "floors": floors,
        "floor_s": median(floors),
        "cases": {},
        "engine_starts": starts,
    }
    for case in cases:
        c = {s: summarize(runs[case][s]) for s in sides}
        if "base" in sides:
            c["first_step_ratio"] = c["base"]["first_step_s"] / c["new"]["first_step_s"]
            c["run_ratio"] = c["base"]["run_s"] / c["new"]["run_s"]
        res["cases"][case] = c
    report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
