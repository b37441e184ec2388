"""Curves of one run or several, drawn from their RUN_DIR/metrics.jsonl into one PNG.

    rlmega plot RUN_DIR [RUN_DIR ...] [--out FILE]     (rlmega train draws RUN_DIR/curves.png as it ends)

    from rlmega.rundir.plots import plot_runs
    titles = plot_runs(["runs/sync", "runs/async"], "curves.png")   # the panels drawn, in order

Panels, over RL steps: the sampled reward's mean, the held-out greedy reward (eval_accuracy: the mean reward of
one temperature-0 answer per eval prompt, an accuracy under a 0/1 reward; only when some run evaluated),
KL to the reference, response length, step time by phase, and the supervised warm start's loss a step (from
RUN_DIR/warm_start.jsonl; only when some run warm-started) (the ``time_*`` keys of rlmega/step.py;
``time_step`` is the whole step, drawn dashed: with produce.strategy=async generation overlaps
training, so the phases are lines, never a stack that would add to more than the step). Several runs
share each panel, one colour per run, named by the folder as given.

The metrics file is read anew on every call (it is what a finished run, a stopped one and a live one
have in common); the PNG is written to a temporary name and renamed, so a viewer never shows half of it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, List, Sequence

from rlmega.rundir.run import WARM_START

CURVES = "curves.png"
METRICS = "metrics.jsonl"
# The phases of a step, in the order they happen; any other time_* key is drawn after them.
PHASE_ORDER = ("wait", "generate", "logprob", "train", "sync")
SMOOTH_WINDOW = 5  # steps in the reward's running mean: one sampled batch's mean is noisy
WARM_TITLE = "warm-start loss"


class MetricsError(ValueError):
    """A run folder without a readable metrics.jsonl; the message names the folder and the fix."""


def read_metrics(run_dir: str | Path) -> List[dict]:
    """Every complete line of RUN_DIR/metrics.jsonl, read from the file now.

    A last line without its newline is a step being written by a live run: left out, not an error.
    """
    path = Path(run_dir) / METRICS
    if not Path(run_dir).is_dir():
        raise MetricsError(
            f"{run_dir} is not a folder. Fix: give the trainer.run_dir of an `rlmega train` run"
        )
    if not path.is_file():
        raise MetricsError(
            f"{run_dir} has no {METRICS}, so there is nothing to draw. Fix: give the trainer.run_dir "
            "of an `rlmega train` run that has logged at least one step"
        )
    text = path.read_text(errors="replace")
    lines = text.split("\n")[:-1]  # the part after the last newline is not a whole line yet
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise MetricsError(
                f"{path} line {i} is not JSON ({e}): {line[:80]!r}. Fix: remove or repair that "
                "line (rlmega writes one JSON object per line)"
            ) from None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise MetricsError(
            f"{path} holds no step yet. Fix: plot again after the run has logged its first step"
        )
    return rows


def read_warm_start(run_dir: str | Path) -> List[float]:
    """The supervised warm start's loss a step (RUN_DIR/warm_start.jsonl, rlmega.rundir.run); [] without one."""
    path = Path(run_dir) / WARM_START
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line)["loss"])
        except (ValueError, KeyError, TypeError):  # a damaged line: the curve without it
            continue
    return [float("nan") if r is None else float(r) for r in rows]


def _series(rows: Iterable[dict], key: str) -> tuple[list, list]:
    """(steps, values) of ``key`` where it is a finite number (null is how NaN was logged)."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _running_mean(ys: Sequence[float], window: int) -> list:
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _phases(runs: Sequence[List[dict]]) -> list[str]:
    """The time_* phases any run logged (without time_step), in step order."""
    found = {
        k[len("time_") :] for rows in runs for r in rows for k in r if k.startswith("time_")
    } - {"step"}
    return [p for p in PHASE_ORDER if p in found] + sorted(found - set(PHASE_ORDER))


DISTILL_TITLE = "KL to the teachers (distillation)"


def _has(runs: Sequence[List[dict]], key: str) -> bool:
    return any(_series(rows, key)[0] for rows in runs)


def panel_titles(runs: Sequence[List[dict]], warm: Sequence[List[float]] = ()) -> list[str]:
    """The panels plot_runs draws for these runs' metrics (and warm-start losses), in order."""
    titles = ["reward (mean)"]
    if _has(runs, "eval_accuracy"):
        titles.append("held-out greedy reward")
    # no KL term (algorithm.kl_coef=0): kl_ref is 0 throughout, and a flat line would read as a measured 0
    if any(y != 0 for rows in runs for y in _series(rows, "kl_ref")[1]):
        titles.append("KL to reference")
    if _has(runs, "distill_kl"):  # on-policy distillation: KL(student || teacher), its k1 estimate
        titles.append(DISTILL_TITLE)
    titles += ["response length (tokens)", "step time by phase (s)"]
    if any(warm):
        titles.append(WARM_TITLE)
    return titles


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> list[str]:
    """Draw the runs' curves into the PNG ``out``; return the panel titles drawn.

    Raises MetricsError for a folder without a readable metrics.jsonl, before anything is written.
    """
    # The Figure API with the Agg canvas, not pyplot: no global figure state and no display needed, so
    # the trainer's driver (and its threads) can draw while other code uses matplotlib.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [str(d) for d in run_dirs]
    runs = [read_metrics(d) for d in run_dirs]
    warm = [read_warm_start(d) for d in run_dirs]
    titles = panel_titles(runs, warm)
    cols = 3 if len(titles) > 4 else 2
    rows_n = -(-len(titles) // cols)
    fig = Figure(figsize=(5 * cols, 3.6 * rows_n), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    keys = {
        "reward (mean)": "reward_mean",
        "held-out greedy reward": "eval_accuracy",
        "KL to reference": "kl_ref",
        DISTILL_TITLE: "distill_kl",
        "response length (tokens)": "response_length",
    }
    phases = _phases(runs)
    # "--" is the whole step
    styles = ["-", ":", "-.", (0, (1, 3)), (0, (3, 1, 1, 1)), (0, (3, 5, 1, 5))]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("supervised step" if title == WARM_TITLE else "RL step")
        ax.grid(alpha=0.3)
        for name, rows, losses, colour in zip(names, runs, warm, colours):
            label = name if len(runs) > 1 else None
            if title == WARM_TITLE:
                ax.plot(range(1, len(losses) + 1), losses, color=colour, label=label)
                continue
            if title == "step time by phase (s)":
                for phase, style in zip(phases, styles * (1 + len(phases) // len(styles))):
                    xs, ys = _series(rows, f"time_{phase}")
                    # one run: a colour per phase; several: a colour per run, a line style per phase
                    if len(runs) == 1:
                        ax.plot(xs, ys, linewidth=1.2, label=phase)
                    else:
                        ax.plot(xs, ys, linestyle=style, linewidth=1.2, color=colour)
                xs, ys = _series(rows, "time_step")
                ax.plot(
                    xs,
                    ys,
                    linestyle="--",
                    linewidth=2.2 if len(runs) > 1 else 1.5,
                    color="black" if len(runs) == 1 else colour,
                    label="whole step" if len(runs) == 1 else None,
                )
                continue
            xs, ys = _series(rows, keys[title])
            # a few points (every trainer.eval_every steps): mark each
            if title == "held-out greedy reward":
                ax.plot(xs, ys, marker="o", color=colour, label=label)
                ax.set_ylim(-0.02, 1.02)
            elif title == "reward (mean)" and len(ys) > 2 * SMOOTH_WINDOW:
                ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=1)
                ax.plot(
                    xs, _running_mean(ys, SMOOTH_WINDOW), color=colour, linewidth=2, label=label
                )
            else:
                ax.plot(xs, ys, color=colour, label=label)
        if title == "step time by phase (s)":
            # colours name the runs (figure legend); grey proxies name the line styles
            if len(runs) > 1:
                for phase, style in zip(phases, styles * (1 + len(phases) // len(styles))):
                    ax.plot([], [], linestyle=style, color="grey", label=phase)
                ax.plot([], [], linestyle="--", linewidth=2.2, color="grey", label="whole step")
            ax.legend(fontsize="small", ncol=2)
        if title == "reward (mean)" and any(
            len(_series(rows, "reward_mean")[1]) > 2 * SMOOTH_WINDOW for rows in runs
        ):
            ax.text(
                0.01,
                0.98,
                f"thick: mean of the last {SMOOTH_WINDOW} steps",
                transform=ax.transAxes,
                fontsize="x-small",
                va="top",
                alpha=0.7,
            )
    for ax in axes[len(titles) :]:
        ax.set_visible(False)
    if len(runs) > 1:  # one legend naming each run by its folder, for every panel
        handles = [axes[0].plot([], [], color=c, linewidth=2)[0] for c in colours]
        fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 4))
    fig.suptitle(names[0] if len(runs) == 1 else f"{len(runs)} runs")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return titles


def plot_run(run_dir: str | Path) -> Path:
    """RUN_DIR/curves.png from RUN_DIR/metrics.jsonl; its path."""
    out = Path(run_dir) / CURVES
    plot_runs([run_dir], out)
    return out
