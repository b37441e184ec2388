"""The `rlmega` command.

    rlmega train CONFIG [key=value ...] [--resume]   the RL trainer (rlmega/train.py); --resume continues from
                                                 the newest complete checkpoint, trainer.resume=PATH from a named one
    rlmega check-config CONFIG [key=value ...]   validate a config, that it runs here, its prompts; print it
    rlmega demo [--steps N] [--run-dir DIR] [key=value ...]   the `make demo` job (see the README)
    rlmega stop RUN_DIR                          ask a running train to checkpoint and stop
    rlmega plot RUN_DIR [RUN_DIR ...] [--out FILE]   curves of one run, or several side by side (rlmega/plots.py)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _check_config(args) -> int:
    from rlmega.config import ConfigError, dump_config, load_config
    from rlmega.config.preflight import preflight

    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)
    except ConfigError as e:
        print(f"rlmega: {e}", file=sys.stderr)
        return 2
    try:  # the prompts, tokenized as `rlmega train` does before any worker: bad rows are named too
        from transformers import AutoTokenizer

        from rlmega.agents.tasks import Tasks

        Tasks(cfg, AutoTokenizer.from_pretrained(cfg.model.path))
    except (ValueError, OSError) as e:  # what train reports as "prompt data: ..." (exit code 2)
        print(f"rlmega: prompt data: {e}", file=sys.stderr)
        return 2
    print(dump_config(cfg), end="")
    return 0


def _demo(args) -> int:
    """Tiny model (made once), then configs/demo_cpu.yaml (or --config): a supervised warm start and RL on addition."""
    import rlmega
    from rlmega.tiny_model import make_tiny_model
    from rlmega.train import main as train_main

    config = Path(args.config) if args.config else Path(rlmega.__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
    if not config.is_file():
        print(f"rlmega demo: {config} not found; the demo needs a source checkout. Fix: pip install -e . "
              "from the repository, or run rlmega train CONFIG with a config of your own", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    model = run_dir / "tiny_model"
    if not (model / "config.json").exists():
        # head_dim 64 (vLLM's CPU attention needs it); 4 heads / 2 KV heads so TP2 splits both.
        make_tiny_model(model, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=0, overwrite=True)
        print(f"rlmega demo: made tiny model in {model}", flush=True)
    return train_main([str(config), f"model.path={model}", f"trainer.run_dir={run_dir}",
                       f"trainer.total_steps={args.steps}", *args.overrides])


def _stop(args) -> int:
    from rlmega.stopping import request_stop

    try:
        path = request_stop(args.run_dir)
    except FileNotFoundError as e:
        print(f"rlmega stop: {e}", file=sys.stderr)
        return 2
    print(f"rlmega stop: asked the run in {args.run_dir} to stop after its current step ({path}); "
          "it checkpoints, releases its workers and exits with code 3")
    return 0


def _plot(args) -> int:
    from rlmega.plots import CURVES, MetricsError, plot_runs

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / CURVES if len(args.run_dirs) == 1 else Path(CURVES)
    try:
        titles = plot_runs(args.run_dirs, out)
    except MetricsError as e:
        print(f"rlmega plot: {e}", file=sys.stderr)
        return 2
    print(f"rlmega plot: {out} ({', '.join(titles)})")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the trainer owns its arguments
        from rlmega.train import main as train_main

        return train_main(argv[1:])
    p = argparse.ArgumentParser(prog="rlmega", description="RL for LLMs on Megatron-core, vLLM and Ray")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-config", help="validate a config and print it resolved")
    c.add_argument("config")
    c.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=10")
    c.set_defaults(fn=_check_config)
    d = sub.add_parser("demo", help="run the foundation demo (what `make demo` runs)")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--config", default="", help="another config on the demo's tiny model, made in RUN_DIR/tiny_model "
                   "(e.g. configs/ppo_gae_cpu.yaml); default configs/demo_cpu.yaml")
    d.add_argument("overrides", nargs="*", help="dotlist overrides of configs/demo_cpu.yaml, e.g. "
                   "trainer.warmup_sft_steps=20 optimizer.lr_warmup_steps=20 (a short run)")
    d.set_defaults(fn=_demo)
    sub.add_parser("train", help="run RL training: rlmega train CONFIG [key=value ...] [--resume] (the newest "
                   "complete checkpoint; trainer.resume=RUN_DIR/checkpoints/step_N resumes from a named one)")
    st = sub.add_parser("stop", help="ask a running `rlmega train` to checkpoint and stop after its current step")
    st.add_argument("run_dir", help="the run's trainer.run_dir")
    st.set_defaults(fn=_stop)
    pl = sub.add_parser("plot", help="draw reward, held-out accuracy, KL, response length and step time of one "
                        "run or several (overlaid, e.g. sync vs async) into a PNG")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="trainer.run_dir of each run (its metrics.jsonl)")
    pl.add_argument("--out", default="", help="the PNG to write; default RUN_DIR/curves.png for one run, "
                    "./curves.png for several")
    pl.set_defaults(fn=_plot)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
