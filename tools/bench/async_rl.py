"""Benchmark: asynchronous vs synchronous RL (median step time, final accuracy), and rlmega vs TRL end to
end, as ratios measured in one run.

    .venv/bin/python tools/bench/async_rl.py                       # both workloads, ~40 min on 2 cores
    .venv/bin/python tools/bench/async_rl.py --workload demo       # the demo workload alone
    .venv/bin/python tools/bench/async_rl.py --workload grpo --trl-python /path/to/trl-venv/bin/python
    .venv/bin/python tools/bench/async_rl.py --smoke               # tiny and short, a few minutes: what CI runs

Modes (MODES): ``sync`` (produce.strategy=sync, the serial loop), ``async_k1`` and ``async_k2``
(produce.strategy=async with max_staleness 1 and 2, in ASYNC_OVERRIDES' schedule: the fast one, requests in
flight at a sync finish on the old weights, TIS rollout correction).

Workloads:
  demo  what `make demo` runs (configs/demo_cpu.yaml: a tiny model made on the spot, TP2 x PP2 on 4 CPU
        ranks + 1 engine, 850 warm-start steps, 80 GRPO steps of 32 prompts x 8, held-out eval every 10),
        one process per mode. Reported: median time_step over the RL steps (the first --warmup left out),
        the ratio to sync's (target <= 0.7), and each mode's final held-out accuracy (target: async's no
        lower than sync's). Each process is a full demo run, so its accuracy is the one a user would get.
  grpo  issue 12's workload (configs/bench_grpo_cpu.yaml, described in tools/bench/grpo_vs_trl.py):
        --grpo-steps steps per process, --rounds rounds; each round runs every mode and TRL once, in an
        order rotated per round (the machine is noisy). Reported: median time_step per mode and the
        end-to-end ratio median(TRL step) / median(rlmega step) per mode (target >= 3 for async).

Both workloads' rlmega processes are `rlmega train` of this checkout; per-step times come from their
metrics.jsonl (time_step: waiting for the batch, log-probs, training and the weight sync; in async mode
generation overlaps training, so time_generate is no longer a part of it). "cpu busy" is the machine's
busy share of its cores over each whole process (warm start and start-up included; every process on the
machine counted): near 1.0 the run is bound by the cores, and overlapping cannot help. ``--json OUT``
writes every number. Modes run whole processes one after another (a run's steps cannot interleave with another's);
the demo's rounds rotate the order like the grpo workload's. One demo run's final accuracy is one sample of
a noisy quantity (100 held-out problems: a standard error of ~5 points): ``--rounds R --vary-seed`` runs
every mode with sampling seeds 0..R-1 and reports each round's accuracy and their mean.

    .venv/bin/python tools/bench/async_rl.py --workload demo --modes sync,async_k1 --rounds 3 --vary-seed

Does the demo learn, robustly? (issue 27) ``--check`` holds each demo run to the bars below and exits 1 when
one misses; ``--layouts`` runs the demo in several layouts (LAYOUTS), ``--plot DIR`` draws each layout's
rounds into one picture (rlmega plot), e.g. the three seeds' curves the README shows:

    .venv/bin/python tools/bench/async_rl.py --workload demo --modes sync --rounds 3 --vary-seed \
        --layouts tp2pp2,world1 --check --plot runs/bench/demo_learns      # 6 demo runs, ~35 min on 2 cores

Bars (CHECK): RL adds >= 25 points of held-out greedy accuracy to the warm-started model (the eval before
RL vs the last one), the sampled reward's mean over the last five RL steps exceeds the first five's by
>= 0.15, and the whole process (model made, warm start, RL, export) takes <= 360 s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grpo_vs_trl", ROOT / "tools/bench/grpo_vs_trl.py")
gvt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gvt)

ASYNC_OVERRIDES = [
    "produce.strategy=async",
    "produce.in_flight=finish",
    "algorithm.rollout_correction=tis",
]
MODES = {
    "sync": ["produce.strategy=sync"],
    "async_k1": [*ASYNC_OVERRIDES, "produce.max_staleness=1"],
    "async_k2": [*ASYNC_OVERRIDES, "produce.max_staleness=2"],
}
TARGET_ASYNC_RATIO, TARGET_TRL_RATIO = 0.7, 3.0
# The demo's layouts a user might try: the config's own (TP2 x PP2 on 4 ranks) and one rank.
LAYOUTS = {
    "tp2pp2": [],
    "world1": [
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
    ],
}
CHECK = {"gain": 0.25, "reward_gain": 0.15, "wall_s": 360.0}  # issue 27's bars on one demo run


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(rows: list[dict]) -> list[dict]:
    keep = (
        "step",
        "time_step",
        "time_wait",
        "time_generate",
        "time_logprob",
        "time_train",
        "time_sync",
        "response_length",
        "reward_mean",
        "staleness_mean",
        "engine_busy_fraction",
        "trainer_busy_fraction",
    )
    return [{k: r.get(k, 0.0) for k in keep} for r in rows if "time_step" in r]


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of this machine so far (/proc/stat); (0, 0) where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(before: tuple[int, int]) -> float | None:
    """The machine's busy share of its CPUs since ``before`` (all processes, ours and others')."""
    busy, total = cpu_times()
    return (busy - before[0]) / (total - before[1]) if total > before[1] else None


def side_name(mode: str, layout: str, args) -> str:
    """A demo run's side: its mode, tagged with its layout when the run has several (``mode@layout``)."""
    return f"{mode}@{layout}" if args.tag_layout else mode


def run_demo(mode: str, layout: str, args, work: Path, rnd: int) -> dict:
    name = f"demo-{layout}-{mode}-r{rnd}"
    seed = [f"rollout.seed={rnd}"] if args.vary_seed else []
    # demo_extra first: it may open with an option (--steps), which must come before the overrides
    cmd = [
        sys.executable,
        "-m",
        "rlmega.cli",
        "demo",
        "--run-dir",
        str(work / name),
        *args.demo_extra,
        *LAYOUTS[layout],
        *MODES[mode],
        *seed,
        "trainer.resume=none",
    ]
    cpu = cpu_times()
    wall = gvt._run(
        f"demo {mode} {layout}", cmd, gvt._rlmega_env(), work / f"{name}.log", args.timeout
    )
    rows = _rows(work / name)
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    out = {
        "workload": "demo",
        "side": side_name(mode, layout, args),
        "layout": layout,
        "run_dir": name,
        "round": rnd,
        "wall_s": wall,
        "cpu_busy": cpu_busy(cpu),
        "steps": _steps(rows),
        "evals": evals,
        "final_accuracy": evals[-1][1] if evals else None,
    }
    return {**out, **learning(out["steps"], evals)}


def learning(steps: list[dict], evals: list[tuple[int, float]]) -> dict:
    """What CHECK judges: held-out accuracy gained over RL (last eval minus the one before RL, step 0) and
    the sampled reward's mean over the last five RL steps minus the first five's."""
    rewards = [s["reward_mean"] for s in steps]
    first, last = rewards[:5], rewards[-5:]
    return {
        "gain": evals[-1][1] - evals[0][1] if len(evals) > 1 and evals[0][0] == 0 else None,
        "reward_first5": statistics.fmean(first) if first else None,
        "reward_last5": statistics.fmean(last) if last else None,
    }


def check(run: dict) -> list[str]:
    """The CHECK bars this demo run misses, in words (empty: it passes)."""
    f5, l5 = run["reward_first5"], run["reward_last5"]
    misses = []
    if run["gain"] is None or run["gain"] < CHECK["gain"]:
        misses.append(f"held-out gain {run['gain']} < {CHECK['gain']}")
    if f5 is None or l5 - f5 < CHECK["reward_gain"]:
        misses.append(
            f"reward last5 - first5 {None if f5 is None else round(l5 - f5, 3)} < {CHECK['reward_gain']}"
        )
    if run["wall_s"] > CHECK["wall_s"]:
        misses.append(f"wall {run['wall_s']:.0f} s > {CHECK['wall_s']:.0f} s")
    return misses


def run_grpo(mode: str, args, overrides: list[str], work: Path, rnd: int) -> dict:
    sub = argparse.Namespace(steps=args.grpo_steps, timeout=args.timeout)
    (work / mode).mkdir(exist_ok=True)
    cpu = cpu_times()
    out = gvt.run_rlmega(sub, [*overrides, *MODES[mode]], work / mode, rnd)
    out.update(
        workload="grpo",
        side=mode,
        cpu_busy=cpu_busy(cpu),
        steps=_steps(_rows(work / mode / f"rlmega-r{rnd}")),
    )
    return out


def median_step(runs: list[dict], workload: str, side: str, warmup: int) -> float | None:
    steps = [
        s["time_step"]
        for r in runs
        if r["workload"] == workload and r["side"] == side
        for s in r["steps"][warmup:]
    ]
    return statistics.median(steps) if steps else None


def summarize(runs: list[dict], warmup: int) -> dict:
    out: dict = {}
    for workload in ("demo", "grpo"):
        sides = sorted({r["side"] for r in runs if r["workload"] == workload})
        if not sides:
            continue
        med = {s: median_step(runs, workload, s, warmup) for s in sides}
        w = out[workload] = {"median_step_s": med}
        if med.get("sync"):
            w["ratio_to_sync"] = {
                s: med[s] / med["sync"] for s in MODES if s != "sync" and med.get(s)
            }
        if workload == "demo":
            rounds = {
                s: [
                    r["final_accuracy"]
                    for r in runs
                    if r["workload"] == "demo"
                    and r["side"] == s
                    and r["final_accuracy"] is not None
                ]
                for s in sides
            }
            w["final_accuracy"] = {s: statistics.fmean(a) for s, a in rounds.items() if a}
            w["final_accuracy_rounds"] = rounds
        if med.get("trl"):
            w["trl_over"] = {s: med["trl"] / med[s] for s in MODES if med.get(s)}
    return out


def report(res: dict) -> None:
    print(
        f"\n{'workload':>8} {'side':>9} {'round':>5} {'wall_s':>7} {'steps':>5} {'median step_s':>13} "
        f"{'wait':>6} {'gen':>6} {'train':>6} {'sync':>6} {'eng busy':>8} {'cpu busy':>8} {'final acc':>9}"
    )
    warmup = res["warmup"]
    for r in res["runs"]:
        steps = r["steps"][warmup:]

        def med(k: str, steps: list = steps) -> float:  # steps bound now: a new list each iteration
            return statistics.median(s.get(k, 0.0) for s in steps) if steps else float("nan")

        acc = f"{r['final_accuracy']:.3f}" if r.get("final_accuracy") is not None else "-"
        cpu = f"{r['cpu_busy']:.2f}" if r.get("cpu_busy") is not None else "-"
        print(
            f"{r['workload']:>8} {r['side']:>9} {r['round']:>5} {r['wall_s']:7.0f} {len(steps):>5} "
            f"{med('time_step'):13.2f} {med('time_wait'):6.2f} {med('time_generate'):6.2f} "
            f"{med('time_train'):6.2f} {med('time_sync'):6.2f} {med('engine_busy_fraction'):8.2f} {cpu:>8} {acc:>9}"
        )
    s = res["summary"]
    for workload, w in s.items():
        print(
            f"\n{workload}: median step "
            + ", ".join(f"{k} {v:.2f} s" for k, v in w["median_step_s"].items())
        )
        for mode, ratio in w.get("ratio_to_sync", {}).items():
            verdict = ""
            if workload == "demo":
                acc_ok = w["final_accuracy"].get(mode, -1) >= w["final_accuracy"].get("sync", 2)
                verdict = (
                    f"  target <= {TARGET_ASYNC_RATIO} at accuracy >= sync's: "
                    f"{'PASS' if ratio <= TARGET_ASYNC_RATIO and acc_ok else 'MISS'}"
                )
            print(f"  {mode}/sync step time {ratio:.2f}{verdict}")
        if "final_accuracy" in w:
            print(
                "  final held-out accuracy: "
                + ", ".join(f"{k} {v:.3f}" for k, v in w["final_accuracy"].items())
            )
            if any(len(a) > 1 for a in w["final_accuracy_rounds"].values()):
                print(
                    "    per round: "
                    + "; ".join(
                        f"{k} " + " ".join(f"{x:.2f}" for x in a)
                        for k, a in w["final_accuracy_rounds"].items()
                    )
                )
        for mode, ratio in w.get("trl_over", {}).items():
            tag = (
                f"  target >= {TARGET_TRL_RATIO}: {'PASS' if ratio >= TARGET_TRL_RATIO else 'MISS'}"
                if mode != "sync"
                else ""
            )
            print(f"  TRL/rlmega {mode} (median step) {ratio:.2f}{tag}")
        if workload == "grpo" and "trl_over" not in w:
            print(f"  TRL: skipped ({res['trl_skipped']})")
    demo = [r for r in res["runs"] if r["workload"] == "demo"]
    if demo:
        print(
            f"\n{'demo run':>26} {'held-out before -> last':>23} {'gain':>6} "
            f"{'reward first5 -> last5':>22} {'wall_s':>6}"
            + ("  check (issue 27)" if res.get("check") else "")
        )
        for r in demo:
            ev = f"{r['evals'][0][1]:.2f} -> {r['evals'][-1][1]:.2f}" if r["evals"] else "-"
            rw = (
                f"{r['reward_first5']:.3f} -> {r['reward_last5']:.3f}"
                if r["reward_first5"] is not None
                else "-"
            )
            verdict = (
                ("  PASS" if not r["misses"] else "  MISS: " + "; ".join(r["misses"]))
                if res.get("check")
                else ""
            )
            print(
                f"{r['run_dir']:>26} {ev:>23} {r['gain'] if r['gain'] is None else format(r['gain'], '+.2f'):>6} "
                f"{rw:>22} {r['wall_s']:6.0f}{verdict}"
            )
    print(f"\nbenchmark runtime {res['runtime_s']:.0f}s")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", choices=["demo", "grpo", "both"], default="both")
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="each round: one process per mode (and TRL)"
    )
    p.add_argument("--grpo-steps", type=int, default=4, help="steps per grpo-workload process")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="first RL steps of each process left out of the medians",
    )
    p.add_argument(
        "--trl-python", default=gvt.DEFAULT_TRL_PYTHON, help="python of TRL's venv (grpo_vs_trl.py)"
    )
    p.add_argument("--trl-threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--timeout", type=float, default=3600, help="seconds one process may take")
    p.add_argument(
        "--vary-seed",
        action="store_true",
        help="demo round r samples with rollout.seed=r, so "
        "that rounds sample the final accuracy's spread (without it a round repeats the same seed)",
    )
    p.add_argument(
        "--layouts",
        default="tp2pp2",
        help=f"demo workload: comma-separated subset of {','.join(LAYOUTS)}",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="hold every demo run to issue 27's bars (CHECK); exit 1 when one misses",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="draw each demo layout and mode's rounds into "
        "DIR/demo-LAYOUT-MODE.png (and keep their metrics in DIR)",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="world size 1, a short warm start, 3 RL steps, demo "
        "workload only, no TRL: a few minutes; CI runs it",
    )
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or (unknown := set(layouts) - set(LAYOUTS)):
        p.error(
            f"--layouts: unknown {sorted(unknown) if layouts else 'none given'}; choose from {list(LAYOUTS)}"
        )
    args.demo_extra, args.tag_layout = [], len(layouts) > 1
    if args.smoke:
        args.workload, args.warmup, layouts = "demo", 1, ["world1"]
        args.demo_extra = [
            "--steps",
            "3",
            "trainer.warmup_sft_steps=20",
            "optimizer.lr_warmup_steps=20",
            "trainer.eval_every=3",
            "trainer.save_every=0",
        ]
    t0 = time.perf_counter()
    # removed on success; kept with its logs on failure
    work = Path(tempfile.mkdtemp(prefix="rlmega-async-bench-"))
    runs: list[dict] = []
    versions, why = (None, "--smoke") if args.smoke else gvt.trl_versions(args.trl_python)
    try:
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            if args.workload in ("demo", "both"):
                for layout in layouts:
                    for mode in order:
                        print(f"round {rnd}: demo {mode} {layout} ...", flush=True)
                        runs.append(run_demo(mode, layout, args, work, rnd))
                        runs[-1]["misses"] = check(runs[-1])
                        print(
                            f"  final accuracy {runs[-1]['final_accuracy']}, "
                            f"process {runs[-1]['wall_s']:.0f} s",
                            flush=True,
                        )
            if args.workload in ("grpo", "both"):
                from rlmega.demo.tiny_model import make_tiny_model

                model = work / "grpo_model"
                if not (model / "config.json").exists():
                    make_tiny_model(
                        model,
                        seed=0,
                        overwrite=True,
                        hidden_size=512,
                        num_layers=8,
                        num_heads=8,
                        num_kv_heads=8,
                    )
                overrides = [f"model.path={model}"]
                sides = order + (["trl"] if versions else [])
                for side in sides if rnd % 2 == 0 else sides[::-1]:
                    print(f"round {rnd}: grpo {side} ...", flush=True)
                    if side == "trl":
                        runs.append(_trl(args, overrides, work, rnd))
                    else:
                        runs.append(run_grpo(side, args, overrides, work, rnd))
                    print(
                        "  steps " + ", ".join(f"{s['time_step']:.1f}" for s in runs[-1]["steps"]),
                        flush=True,
                    )
    except gvt.SideFailed as e:
        print(f"async_rl: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.plot:
        plot_demo(runs, work, Path(args.plot))
    res = {
        "runs": runs,
        "warmup": args.warmup,
        "modes": {m: MODES[m] for m in modes},
        "check": args.check,
        "trl_skipped": why or None,
        "summary": summarize(runs, args.warmup),
        "runtime_s": time.perf_counter() - t0,
    }
    report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    if args.check and any(r["misses"] for r in runs if r["workload"] == "demo"):
        print("async_rl --check: a demo run missed issue 27's bars (MISS above)", file=sys.stderr)
        raise SystemExit(1)
    return res


def plot_demo(runs: list[dict], work: Path, out: Path) -> None:
    """One picture per demo layout and mode, its rounds (seeds) overlaid; their metrics kept beside it."""
    from rlmega.rundir.plots import plot_runs

    out.mkdir(parents=True, exist_ok=True)
    for layout, mode in sorted(
        {(r["layout"], r["side"].split("@")[0]) for r in runs if r["workload"] == "demo"}
    ):
        names = [
            r["run_dir"]
            for r in runs
            if r["workload"] == "demo" and r["layout"] == layout and r["side"].split("@")[0] == mode
        ]
        # metrics.jsonl alone: the picture's data, small (checkpoints stay behind)
        for name in names:
            (out / name).mkdir(exist_ok=True)
            shutil.copy2(work / name / "metrics.jsonl", out / name / "metrics.jsonl")
        # the legend names the runs by their folder, not a temporary path
        with contextlib.chdir(out):
            plot_runs(names, f"demo-{layout}-{mode}.png")
        print(f"wrote {out / f'demo-{layout}-{mode}.png'}", flush=True)


def _trl(args, overrides: list[str], work: Path, rnd: int) -> dict:
    """TRL's GRPOTrainer on the grpo workload, as grpo_vs_trl.py runs it (its best CPU settings)."""
    from rlmega.config import load_config

    cfg = load_config(str(gvt.CONFIG), overrides)
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(gvt.step_prompts(cfg, args.grpo_steps)))
    sub = argparse.Namespace(
        trl_python=args.trl_python,
        steps=args.grpo_steps,
        threads=args.trl_threads,
        trl_threads=args.trl_threads,
        trl_micro_batch=64,
        trl_generation="generate",
        timeout=args.timeout,
    )
    cpu = cpu_times()
    out = gvt.run_trl(sub, cfg, prompts, work, rnd)
    out.update(workload="grpo", side="trl", cpu_busy=cpu_busy(cpu))
    return out


if __name__ == "__main__":
    main()
