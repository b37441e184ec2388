"""The `rlmega` command.

rlmega train CONFIG [key=value ...] [--resume]   the RL trainer (rlmega/train.py); --resume continues from
                                             the newest complete checkpoint, trainer.resume=PATH from a named one
rlmega check-config CONFIG [key=value ...]   validate a config, that it runs here, its prompts; print it
rlmega demo [--config CONFIG] [--steps N] [--run-dir DIR] [key=value ...]   the demo's tiny model, then
                                             train CONFIG (default configs/demo_cpu.yaml) on it: `make demo`
rlmega stop RUN_DIR                          ask a running train to checkpoint and stop
rlmega plot RUN_DIR [RUN_DIR ...] [--out FILE]   curves of one run, or several side by side (rlmega/rundir/plots.py)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path


class PromptDataError(ValueError):
    """A prompt file's rows cannot be read or tokenized (what `rlmega train` reports as "prompt data: ...")."""


def check_config(config: str | Path, overrides=(), with_tasks: bool = False):
    """What `rlmega check-config` checks, in this process: the config against the schema and itself, against
    this machine (preflight), its prompts tokenized as `rlmega train` does before any worker starts, and each
    reward function called once on a task's first row (rlmega/judgers/first_row.py). The resolved RLConfig
    (and its Tasks, ``with_tasks``); ConfigError (each problem by field, with its fix) or PromptDataError."""
    from rlmega.config import ConfigError, load_config
    from rlmega.preflight import preflight

    cfg = load_config(config, list(overrides))
    preflight(cfg)
    try:  # bad rows are named by file and row
        from transformers import AutoTokenizer

        from rlmega.agents.tasks import Tasks
        from rlmega.config.resolved import task_configs

        tasks = Tasks(
            task_configs(cfg),
            AutoTokenizer.from_pretrained(cfg.model.path),
            prompts_per_step=cfg.trainer.prompts_per_step,
            model_path=cfg.model.path,
            rollout=cfg.rollout,
        )
    except (ValueError, OSError) as e:
        raise PromptDataError(f"prompt data: {e}") from e
    from rlmega.judgers.first_row import first_row_problems

    problems = first_row_problems(cfg.reward, tasks, named_tasks=bool(cfg.tasks))
    if problems:
        raise ConfigError(problems)
    return (cfg, tasks) if with_tasks else cfg


def summary(cfg, tasks) -> str:
    """check-config's last line: the model (family, parameters from its safetensors headers), the layout, the
    prompts kept and dropped."""
    import json
    import struct

    model = Path(cfg.model.path)
    hf = json.loads((model / "config.json").read_text())
    params = 0
    # the header alone (u64 length, then JSON): nothing mapped
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        params += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M" if params else "?"
    p = cfg.parallelism
    layout = (
        f"megatron TP{p.tensor_model_parallel_size} x PP{p.pipeline_model_parallel_size}"
        if cfg.actor.backend == "megatron"
        else cfg.actor.backend
    ) + f", world {p.world_size}"
    kept = sum(len(d.train) for d in tasks.data.values())
    dropped = sum(d.train.num_filtered for d in tasks.data.values())
    return (
        f"rlmega check-config: OK. {hf.get('model_type', '?')}, {size} parameters; {layout}; {kept} prompts "
        f"kept, {dropped} dropped (longer than rollout.max_prompt_tokens)"
    )


def _check_config(args) -> int:
    from rlmega.config import ConfigError, dump_config

    try:
        cfg, tasks = check_config(args.config, args.overrides, with_tasks=True)
    # exit code 2, as `rlmega train` gives for its input
    except (ConfigError, PromptDataError) as e:
        print(f"rlmega: {e}", file=sys.stderr)
        return 2
    print(dump_config(cfg), end="")
    print(summary(cfg, tasks))
    return 0


# The demo's tiny Qwen2: head_dim 64 (vLLM's CPU attention needs it); 4 heads / 2 KV heads so TP2 splits both.
DEMO_MODEL = dict(hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=0)


def _config_value(config: Path, overrides, dotted: str, default):
    """A value as the config file and dotlist overrides set it, read before the model exists (load_config
    checks the model folder, which the demo has yet to make); ``default`` where neither sets it."""
    from omegaconf import OmegaConf

    raw = OmegaConf.merge(
        OmegaConf.load(config), OmegaConf.from_dotlist([o for o in overrides if "=" in o])
    )
    value = OmegaConf.select(raw, dotted, default=None)
    return default if value is None else value


def _demo(args) -> int:
    """Tiny model (made once, in RUN_DIR/tiny_model), then configs/demo_cpu.yaml (or --config) on it."""
    import rlmega
    from rlmega.demo.tiny_model import make_tiny_model
    from rlmega.train import main as train_main

    demo_config = Path(rlmega.__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
    config = Path(args.config) if args.config else demo_config
    if not config.is_file():
        print(
            f"rlmega demo: {config} not found; the demo needs a source checkout. Fix: pip install -e . "
            "from the repository, or run rlmega train CONFIG with a config of your own",
            file=sys.stderr,
        )
        return 2
    # the config's own run folder and length unless given here (configs/*.yaml's first lines rely on it)
    run_dir = Path(
        args.run_dir or _config_value(config, args.overrides, "trainer.run_dir", "runs/demo")
    )
    model = run_dir / "tiny_model"
    if not (model / "config.json").exists():
        # RoPE has no trained positions: the context is only what the config says engines may hold
        # (configs/long_context_cpu.yaml's 8k-token answers need more than the default 512).
        longest = sum(
            int(_config_value(config, args.overrides, f"rollout.max_{k}_tokens", d))
            for k, d in (("prompt", 64), ("response", 32))
        )
        make_tiny_model(
            model, **DEMO_MODEL, max_position_embeddings=max(512, longest), overwrite=True
        )
        print(f"rlmega demo: made tiny model in {model}", flush=True)
    if int(_config_value(config, args.overrides, "actor.lora.rank", 0)) and not int(
        _config_value(config, args.overrides, "trainer.warmup_sft_steps", 0)
    ):
        # LoRA adapts a trained model, and the demo's is random (its frozen embeddings and head included): the
        # demo's own full-parameter warm start (configs/demo_cpu.yaml, no RL steps) first, exported once into
        # RUN_DIR/warm_start/hf_final, is the LoRA run's base (and its reference: the KL anchors there)
        warm = run_dir / "warm_start"
        if not (warm / "hf_final" / "config.json").exists():
            print(
                f"rlmega demo: LoRA needs a trained base: the demo's warm start first, into {warm}",
                flush=True,
            )
            rc = train_main(
                [
                    str(demo_config),
                    f"model.path={model}",
                    f"trainer.run_dir={warm}",
                    "trainer.total_steps=0",
                    "trainer.resume=none",
                ]
            )
            if rc:
                return rc
        model = warm / "hf_final"
    steps = [f"trainer.total_steps={args.steps}"] if args.steps is not None else []
    return train_main(
        [str(config), f"model.path={model}", f"trainer.run_dir={run_dir}", *steps, *args.overrides]
    )


def _stop(args) -> int:
    from rlmega.rundir.stopping import request_stop

    try:
        path = request_stop(args.run_dir)
    except FileNotFoundError as e:
        print(f"rlmega stop: {e}", file=sys.stderr)
        return 2
    print(
        f"rlmega stop: asked the run in {args.run_dir} to stop after its current step ({path}); "
        "it checkpoints, releases its workers and exits with code 3"
    )
    return 0


def _plot(args) -> int:
    from rlmega.rundir.plots import CURVES, MetricsError, plot_runs

    out = (
        Path(args.out)
        if args.out
        else Path(args.run_dirs[0]) / CURVES
        if len(args.run_dirs) == 1
        else Path(CURVES)
    )
    try:
        titles = plot_runs(args.run_dirs, out)
    except MetricsError as e:
        print(f"rlmega plot: {e}", file=sys.stderr)
        return 2
    print(f"rlmega plot: {out} ({', '.join(titles)})")
    return 0


def parser() -> argparse.ArgumentParser:
    """The `rlmega` command's parser (`rlmega train`'s own arguments: rlmega.train_args.parse)."""
    p = argparse.ArgumentParser(
        prog="rlmega", description="RL for LLMs on Megatron-core, vLLM and Ray"
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-config", help="validate a config and print it resolved")
    c.add_argument("config")
    c.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=10")
    c.set_defaults(fn=_check_config)
    d = sub.add_parser(
        "demo",
        help="make the demo's tiny model in RUN_DIR/tiny_model (once), then train on it "
        "(what `make demo` runs)",
    )
    d.add_argument(
        "--run-dir",
        default="",
        help="default: the config's trainer.run_dir (runs/demo for the demo)",
    )
    d.add_argument(
        "--steps",
        type=int,
        default=None,
        help="RL steps; default: the config's trainer.total_steps",
    )
    d.add_argument(
        "--config",
        default="",
        help="another config on the demo's tiny model, made in RUN_DIR/tiny_model "
        "(e.g. configs/ppo_gae_cpu.yaml); default configs/demo_cpu.yaml",
    )
    d.add_argument(
        "overrides",
        nargs="*",
        help="dotlist overrides of configs/demo_cpu.yaml, e.g. "
        "trainer.warmup_sft_steps=20 optimizer.lr_warmup_steps=20 (a short run)",
    )
    d.set_defaults(fn=_demo)
    sub.add_parser(
        "train",
        help="run RL training: rlmega train CONFIG [key=value ...] [--resume] (the newest "
        "complete checkpoint; trainer.resume=RUN_DIR/checkpoints/step_N resumes from a named one)",
    )
    st = sub.add_parser(
        "stop", help="ask a running `rlmega train` to checkpoint and stop after its current step"
    )
    st.add_argument("run_dir", help="the run's trainer.run_dir")
    st.set_defaults(fn=_stop)
    pl = sub.add_parser(
        "plot",
        help="draw reward, held-out greedy reward, KL, response length and step time of one "
        "run or several (overlaid, e.g. sync vs async) into a PNG",
    )
    pl.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="trainer.run_dir of each run (its metrics.jsonl)",
    )
    pl.add_argument(
        "--out",
        default="",
        help="the PNG to write; default RUN_DIR/curves.png for one run, ./curves.png for several",
    )
    pl.set_defaults(fn=_plot)
    return p


def entry() -> None:
    """The ``rlmega`` console script: :func:`main` with its start-up imports uncollected (rlmega/process/heap.py), then
    leave without the interpreter's teardown (rlmega/launch/process_exit.py)."""
    from rlmega.launch.process_exit import leave

    leave(main(process_start=True))


def main(argv=None, process_start: bool = False) -> int:
    """``process_start``: this process was started for this command (the console script): its heavy imports go
    uncollected and frozen (rlmega/process/heap.py); a caller that imports rlmega keeps its collector as it is."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the trainer owns its arguments
        from rlmega.train_args import parse as parse_train_args

        parse_train_args(argv[1:])  # --help and usage errors answer here, before the heavy imports
        from rlmega.process.heap import imports_uncollected

        with imports_uncollected() if process_start else contextlib.nullcontext():
            from rlmega.train import main as train_main

        return train_main(argv[1:])
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    entry()
