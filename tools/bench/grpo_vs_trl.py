"""Benchmark: end-to-end GRPO step time, TRL's GRPOTrainer / rlmega, as a ratio measured in one run.

    .venv/bin/python tools/bench/grpo_vs_trl.py                      # the issue-12 workload, ~10-15 min
    .venv/bin/python tools/bench/grpo_vs_trl.py --rounds 3 --steps 4 --json runs/bench/grpo_vs_trl.json
    .venv/bin/python tools/bench/grpo_vs_trl.py --smoke              # a tiny model, about a minute; what CI runs
    make bench-grpo                                                  # makes TRL's venv if missing, then the default

TRL runs in its own environment (it is not a dependency of rlmega): ``make bench-trl-env`` makes
runs/bench/trl-venv, or by hand::

    python3.11 -m venv runs/bench/trl-venv
    runs/bench/trl-venv/bin/pip install torch==2.13.0      # the CPU build, as rlmega's own Makefile installs it
    runs/bench/trl-venv/bin/pip install trl==1.16.0

``--trl-python`` picks its interpreter (default: $RLMEGA_TRL_PYTHON, else runs/bench/trl-venv/bin/python).
Without it the benchmark stops and prints these commands; ``--smoke`` runs rlmega's side alone and
reports TRL as skipped, with the reason (CI has no TRL venv).

The workload (issue 12), identical on both sides: a random Qwen2 of 21,052,928 parameters
(tools/make_tiny_model.py --hidden-size 512 --num-layers 8 --num-heads 8 --num-kv-heads 8, float32),
8 addition prompts per step (rlmega's synthetic arithmetic data) x 8 samples, up to 128 new tokens,
temperature 1, reward rlmega.rewards.arithmetic.score, GRPO advantages, KL 0.04 (k3) to the frozen
start, AdamW lr 1e-4, grad clip 1.0, one optimizer step per RL step (64 samples), token-mean loss.
Both sides draw the same prompts in the same order: rlmega's own data code (load_prompt_data, seeded)
picks each step's 8 problems, and the TRL side gets them as a JSON file with ``shuffle_dataset=False``.

* rlmega: ``python -m rlmega.cli train configs/bench_grpo_cpu.yaml`` (this checkout's code) on its
  DEFAULT layout for one CPU machine: the config sets the workload only, no parallelism, threads or
  micro-batch budget. Per-step times are metrics.jsonl's time_step and phases.
* TRL 1.16: tools/bench/trl_grpo_side.py in TRL's venv, GRPOTrainer at its fastest CPU setting we found:
  ``bf16=False`` (the default bf16 autocast made a step 400+ s here) and ``gradient_checkpointing=False``
  (the default recomputes every forward); float32 like rlmega; torch threads = this machine's cores
  (``--trl-threads``; on a busy machine 1 can beat 2: generate's many small ops stall whenever one
  OpenMP thread is descheduled, 8x the CPU time in one trial under load; compare both on a quiet
  machine and keep TRL's faster); one micro-batch of all 64 samples (TRL pads every sample of a step
  to the step's longest before splitting, so smaller micro-batches only shrink the matmuls); plain
  ``model.generate`` with its KV cache (``use_cache`` is on by default; TRL's vLLM path needs a CUDA
  vLLM server, and transformers' continuous batching, ``--trl-generation continuous_batching``,
  took as much or more CPU time in a trial here); sdpa attention (transformers' default);
  ``dataloader_num_workers=0`` (8 strings a step: a worker only adds start-up); no old-log-prob
  forward (TRL skips it when generation and the optimizer step line up, as here); logging every step,
  no saving, report_to none.
  Its step is timed from ``on_step_begin`` to ``on_step_end``: generation included.

Rounds interleave the sides (the machine is noisy): round r runs one TRL process for ``--steps``
steps and one rlmega process for as many, TRL first in even rounds and rlmega first in odd ones.
Each process's first ``--warmup`` steps are left out; medians are over all the other steps of a side.
Each process starts from the same random model and the same prompts; round r samples with seed r on
both sides (rollout.seed; TRL's seed), so the rounds' response lengths differ and average out.

Printed per process (round, side), then per side (medians over measured steps), all in seconds:

    step_s      each step's wall time (rlmega: metrics.jsonl time_step; TRL: the callback).
    generate    sampling the 64 responses (rlmega: vLLM engine; TRL: model.generate + decode).
    reward      scoring them (rlmega: 0, its agent loops judge each response as it finishes: in generate).
    logprob     the frozen reference's log-probs (+ advantages); rlmega computes no separate old
                log-probs on-policy, nor does TRL here.
    train       forward + backward + optimizer step (TRL: time_step minus the phases above).
    sync        rlmega: the new weights into the vLLM engine; TRL: none (it generates with the trainee).
    resp_len    mean response length in tokens (a random model's lengths decide the cost: compare them).
    wall_s      the whole process, start-up and shutdown included (not in the ratio).

then each round's ratio of medians, and the ratio median(TRL step_s) / median(rlmega step_s) over all
rounds against the target (>= 2.5, issue 26): PASS or MISS.
Response lengths differing by more than 15% are flagged, since then the sides did different work.
The default (2 rounds x 3 steps a side) should take 10-15 minutes on a quiet 2-core machine (an
estimate: it took 17 minutes on a 2-core machine shared with other jobs, load 4-10, where TRL's steps
took 57-207 s as the load varied); it prints its runtime. ``--json OUT`` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "bench_grpo_cpu.yaml"
TRL_SIDE = ROOT / "tools" / "bench" / "trl_grpo_side.py"
REWARD_FILE = ROOT / "rlmega" / "rewards" / "arithmetic.py"
DEFAULT_TRL_PYTHON = os.environ.get("RLMEGA_TRL_PYTHON") or str(
    ROOT / "runs/bench/trl-venv/bin/python"
)
TARGET = 2.5  # issue 26
PHASES = ("generate", "reward", "logprob", "train", "sync")
LENGTH_TOLERANCE = 0.15
TRL_ENV_HELP = """TRL runs in its own environment, not rlmega's. Make it with
    make bench-trl-env                                   (creates runs/bench/trl-venv)
or by hand:
    python3.11 -m venv runs/bench/trl-venv
    runs/bench/trl-venv/bin/pip install torch==2.13.0
    runs/bench/trl-venv/bin/pip install trl==1.16.0
then run with --trl-python runs/bench/trl-venv/bin/python (or set RLMEGA_TRL_PYTHON)."""
# A launcher's variables would make `rlmega train` think torchrun started it.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class SideFailed(RuntimeError):
    pass


def trl_versions(python: str) -> tuple[dict | None, str]:
    """(versions, "") when ``python`` imports trl and torch, else (None, why not)."""
    if not Path(python).is_file():
        return None, f"{python} does not exist"
    code = (
        "import json, torch, transformers, trl; print(json.dumps(dict(torch=torch.__version__, "
        "transformers=transformers.__version__, trl=trl.__version__)))"
    )
    try:
        proc = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=300, env=_trl_env()
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} does not run: {e}"
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot import torch/transformers/trl ({last})"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def _trl_env() -> dict:
    # No PYTHONPATH: the TRL side must not pick up rlmega or its venv's packages.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in LAUNCHER_VARS}


def _rlmega_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    # this checkout's code
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def step_prompts(cfg, steps: int) -> list[list[dict]]:
    """The prompts rlmega draws for its first ``steps`` steps, as {prompt, label} rows for TRL."""
    from transformers import AutoTokenizer

    from rlmega.data.prompts import load_prompt_data

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    data = load_prompt_data(
        cfg.data, tok, cfg.rollout.max_prompt_tokens, cfg.trainer.prompts_per_step
    )
    out = []
    for _ in range(steps):
        batch = data.next_prompts()
        # TRL tokenizes the text itself (tokenizer(text=...)): it must get the same ids
        for p in batch:
            if tok(text=p.text)["input_ids"] != list(p.token_ids):
                raise SystemExit(
                    f"prompt {p.text!r}: the tokenizer's ids differ from rlmega's; the sides would differ"
                )
        out.append([{"prompt": p.text, "label": p.label} for p in batch])
    return out


def _run(name: str, cmd: list[str], env: dict, log: Path, timeout: float) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout:.0f}s"
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SideFailed(f"{name} failed ({rc}); log {log}, last lines:\n{tail}")
    return time.perf_counter() - t0


def run_rlmega(args, overrides: list[str], work: Path, rnd: int) -> dict:
    run_dir = work / f"rlmega-r{rnd}"
    cmd = [
        sys.executable,
        "-m",
        "rlmega.cli",
        "train",
        str(CONFIG),
        *overrides,
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={args.steps}",
        f"rollout.seed={rnd}",
    ]
    wall = _run("rlmega", cmd, _rlmega_env(), work / f"rlmega-r{rnd}.log", args.timeout)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # rlmega's agent loops judge while they generate: its time_generate holds both, time_reward is 0.
    steps = [
        {
            "step": r["step"],
            "time_step": r["time_step"],
            **{f"time_{p}": r.get(f"time_{p}", 0.0) for p in PHASES},
            "time_wait": r.get(
                "time_wait", r.get("time_generate", 0.0)
            ),  # the step waiting for its batch
            "response_length": r["response_length"],
            "reward_mean": r["reward_mean"],
        }
        for r in rows
        if "time_step" in r
    ]
    return {"side": "rlmega", "round": rnd, "wall_s": wall, "steps": steps}


def run_trl(args, cfg, prompts_file: Path, work: Path, rnd: int) -> dict:
    out = work / f"trl-r{rnd}.json"
    cmd = [
        args.trl_python,
        str(TRL_SIDE),
        "--model",
        cfg.model.path,
        "--prompts",
        str(prompts_file),
        "--reward-file",
        str(REWARD_FILE),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.trl_threads),
        "--micro-batch",
        str(args.trl_micro_batch),
        "--generation",
        args.trl_generation,
        "--num-generations",
        str(cfg.rollout.n),
        "--max-completion-length",
        str(cfg.rollout.max_response_tokens),
        "--beta",
        str(cfg.algorithm.kl_coef),
        "--lr",
        str(cfg.optimizer.lr),
        "--seed",
        str(rnd),
    ]
    wall = _run("TRL", cmd, _trl_env(), work / f"trl-r{rnd}.log", args.timeout)
    steps = json.loads(out.read_text())["steps"]
    for s in steps:
        s["time_sync"] = 0.0  # TRL generates with the model it trains: nothing to sync
    return {"side": "trl", "round": rnd, "wall_s": wall, "steps": steps}


def summarize(runs: list[dict], side: str, warmup: int) -> dict | None:
    measured = [s for r in runs if r["side"] == side for s in r["steps"][warmup:]]
    if not measured:
        return None
    med = {p: statistics.median(s[f"time_{p}"] for s in measured) for p in PHASES}
    return {
        "steps": len(measured),
        "step_s": statistics.median(s["time_step"] for s in measured),
        **med,
        "response_length": statistics.fmean(s["response_length"] for s in measured),
        "reward_mean": statistics.fmean(s.get("reward_mean") or 0.0 for s in measured),
    }


def report(res: dict, warmup: int) -> None:
    head = (
        f"{'round':>5} {'side':>6} {'wall_s':>7} "
        + " ".join(f"{c:>8}" for c in (*PHASES, "resp_len"))
        + "  step_s"
    )
    print("\n" + head)
    for r in res["runs"]:
        for i, s in enumerate(r["steps"]):
            tag = " (warm-up)" if i < warmup else ""
            wall = f"{r['wall_s']:7.1f}" if i == 0 else " " * 7
            print(
                f"{r['round']:>5} {r['side']:>6} {wall} "
                + " ".join(f"{s[f'time_{p}']:8.2f}" for p in PHASES)
                + f" {s['response_length']:8.1f}  {s['time_step']:.2f}{tag}"
            )
    print()
    for rnd in sorted({r["round"] for r in res["runs"]}):
        per = {
            side: summarize([r for r in res["runs"] if r["round"] == rnd], side, warmup)
            for side in ("trl", "rlmega")
        }
        if per["trl"] and per["rlmega"]:
            print(
                f"round {rnd}: TRL/rlmega {per['trl']['step_s'] / per['rlmega']['step_s']:.2f} "
                f"(median step {per['trl']['step_s']:.2f} / {per['rlmega']['step_s']:.2f} s)"
            )
    print(f"\nmedians over the measured steps (each process's first {warmup} left out):")
    print(
        f"{'side':>6} {'steps':>5} {'step_s':>8} "
        + " ".join(f"{c:>8}" for c in (*PHASES, "resp_len"))
    )
    s = res["summary"]
    for side in ("trl", "rlmega"):
        m = s[side]
        if m is None:
            print(
                f"{side:>6}  skipped: {res['trl']['skipped']}"
                if side == "trl"
                else f"{side:>6}  no measured steps"
            )
            continue
        print(
            f"{side:>6} {m['steps']:>5} {m['step_s']:8.2f} "
            + " ".join(f"{m[p]:8.2f}" for p in PHASES)
            + f" {m['response_length']:8.1f}"
        )
    if s["length_gap"] is not None and s["length_gap"] > LENGTH_TOLERANCE:
        print(
            f"NOTE: mean response lengths differ by {s['length_gap']:.0%} (TRL {s['trl']['response_length']:.1f}, "
            f"rlmega {s['rlmega']['response_length']:.1f} tokens): the sides did different amounts of work"
        )
    if s["ratio"] is None:
        print(f"\nratio TRL/rlmega: n/a (TRL skipped); target >= {TARGET}")
    else:
        print(
            f"\nratio TRL/rlmega (median step time): {s['ratio']:.2f}   target >= {TARGET}: "
            f"{'PASS' if s['pass'] else 'MISS'}"
        )
    print(f"benchmark runtime {res['runtime_s']:.0f}s")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--trl-python", default=DEFAULT_TRL_PYTHON, help="python of TRL's venv (see above)"
    )
    p.add_argument("--rounds", type=int, default=2, help="each round: one process per side")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per process")
    p.add_argument(
        "--warmup", type=int, default=1, help="first steps of each process left out of the medians"
    )
    p.add_argument(
        "--trl-threads", type=int, default=len(os.sched_getaffinity(0)), help="TRL's torch threads"
    )
    p.add_argument(
        "--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size"
    )
    p.add_argument(
        "--trl-generation", choices=["generate", "continuous_batching"], default="generate"
    )
    p.add_argument(
        "--model-dir", default=None, help="reuse or keep the generated model folder here"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds one process may take")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, 2 steps a side, 1 round: seconds-to-a-minute; CI runs it",
    )
    args = p.parse_args(argv)
    shape = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8)
    extra = []
    if args.smoke:  # head_dim 64: vLLM's CPU attention needs it
        shape = dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2)
        args.rounds, args.steps, args.warmup = 1, 2, 1
        extra = ["rollout.max_response_tokens=16"]
    if args.steps <= args.warmup:
        p.error(
            f"--steps {args.steps} must exceed --warmup {args.warmup}: nothing would be measured"
        )
    t_start = time.perf_counter()

    versions, why = trl_versions(args.trl_python)
    if versions is None and not args.smoke:
        print(f"grpo_vs_trl: no TRL to compare with: {why}.\n{TRL_ENV_HELP}", file=sys.stderr)
        raise SystemExit(2)

    from rlmega.config import load_config
    from rlmega.demo.tiny_model import make_tiny_model

    # removed on success; kept with its logs on failure
    work = Path(tempfile.mkdtemp(prefix="rlmega-grpo-vs-trl-"))
    model_dir = Path(args.model_dir).resolve() if args.model_dir else work / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, seed=0, overwrite=True, **shape)
    overrides = [f"model.path={model_dir}", *extra]
    cfg = load_config(str(CONFIG), overrides)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(step_prompts(cfg, args.steps)))
    workload = {
        "model": {**shape, "path": str(model_dir)},
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "n": cfg.rollout.n,
        "max_new_tokens": cfg.rollout.max_response_tokens,
        "kl_coef": cfg.algorithm.kl_coef,
        "kl_estimator": cfg.algorithm.kl_estimator,
        "lr": cfg.optimizer.lr,
        "dtype": cfg.model.dtype,
    }
    print(
        f"workload: {workload}\nTRL: {versions or 'skipped: ' + why}; threads {args.trl_threads}, "
        f"micro-batch {args.trl_micro_batch}, {args.trl_generation}",
        flush=True,
    )

    runs: list[dict] = []
    for rnd in range(args.rounds):
        order = ["trl", "rlmega"] if rnd % 2 == 0 else ["rlmega", "trl"]
        for side in order:
            if side == "trl" and versions is None:
                continue
            print(f"round {rnd}: {side}, {args.steps} steps ...", flush=True)
            try:
                run = (
                    run_trl(args, cfg, prompts_file, work, rnd)
                    if side == "trl"
                    else run_rlmega(args, overrides, work, rnd)
                )
            except SideFailed as e:
                print(f"grpo_vs_trl: {e}", file=sys.stderr)
                raise SystemExit(1) from None
            runs.append(run)
            times = ", ".join(f"{s['time_step']:.1f}" for s in run["steps"])
            print(f"  {side}: steps {times} s (process {run['wall_s']:.0f} s)", flush=True)

    summary = {side: summarize(runs, side, args.warmup) for side in ("trl", "rlmega")}
    both = summary["trl"] and summary["rlmega"]
    ratio = summary["trl"]["step_s"] / summary["rlmega"]["step_s"] if both else None
    lengths = (
        (summary["trl"]["response_length"], summary["rlmega"]["response_length"]) if both else None
    )
    summary.update(
        ratio=ratio,
        target=TARGET,
        **{"pass": ratio is not None and ratio >= TARGET},
        length_gap=abs(lengths[0] - lengths[1]) / min(lengths) if lengths else None,
    )
    res = {
        "workload": workload,
        "config": str(CONFIG.relative_to(ROOT)),
        "trl": {
            "python": args.trl_python,
            "versions": versions,
            "skipped": why or None,
            "threads": args.trl_threads,
            "micro_batch": args.trl_micro_batch,
            "generation": args.trl_generation,
        },
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": runs,
        "summary": summary,
        "runtime_s": time.perf_counter() - t_start,
    }
    report(res, args.warmup)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
