"""Curves from metrics.jsonl (rlmega/rundir/plots.py) and `rlmega plot`, on metrics files written here in the
trainer's format (rlmega/rundir/run.py: one JSON object a line, NaN logged as null, a step-0 eval line)."""

import json
import math
import struct

import pytest

from rlmega.cli import main as cli_main
from rlmega.rundir.plots import (
    CURVES,
    MetricsError,
    panel_titles,
    plot_run,
    plot_runs,
    read_metrics,
)
from rlmega.rundir.run import RunDir

ALL_PANELS = [
    "reward (mean)",
    "held-out greedy reward",
    "KL to reference",
    "response length (tokens)",
    "step time by phase (s)",
]


def _step(step: int, reward: float, **extra) -> dict:
    return {
        "step": step,
        "reward_mean": reward,
        "kl_ref": 0.001 * step,
        "response_length": 4.0 + step % 3,
        "time_wait": 0.5,
        "time_generate": 0.6,
        "time_logprob": 0.1,
        "time_train": 0.7,
        "time_sync": 0.05,
        "time_step": 1.4,
        "loss": float("nan"),
        **extra,
    }


def _write_run(path, steps=12, eval_every=0):
    """A run folder as `rlmega train` leaves it, written through the trainer's own RunDir."""
    run = RunDir(path, tensorboard=False)
    if eval_every:
        run.log({"step": 0, "eval_accuracy": 0.3})
    for s in range(1, steps + 1):
        run.log(
            _step(
                s,
                0.1 + 0.02 * s,
                **({"eval_accuracy": 0.3 + 0.01 * s} if eval_every and s % eval_every == 0 else {}),
            )
        )
    run.close()
    return path


def _png_size(path):
    """(width, height) from the PNG's signature and IHDR chunk: the file is a whole, valid PNG header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_one_run_draws_every_panel_into_a_valid_png(tmp_path):
    run = _write_run(tmp_path / "run", eval_every=5)
    out = plot_run(run)
    assert out == run / CURVES
    w, h = _png_size(out)
    assert w > 800 and h > 500
    assert panel_titles([read_metrics(run)]) == ALL_PANELS
    from matplotlib.image import imread

    assert imread(out).shape[:2] == (h, w)  # matplotlib reads back what it wrote
    assert not list(run.glob(".*tmp"))  # the temporary name was renamed, not left behind


def test_a_run_without_a_kl_term_draws_no_kl_panel(tmp_path):
    """algorithm.kl_coef=0 logs kl_ref 0 every step: a flat line would read as a measured 0 (issue 56)."""
    run = RunDir(tmp_path / "run", tensorboard=False)
    for s in range(1, 5):
        run.log(_step(s, 0.1, kl_ref=0.0))
    run.close()
    assert plot_run(tmp_path / "run").exists()
    assert panel_titles([read_metrics(tmp_path / "run")]) == [
        t for t in ALL_PANELS if t not in ("held-out greedy reward", "KL to reference")
    ]


def test_a_warm_started_run_draws_its_warm_start_loss(tmp_path):
    """Issue 56: the warm-start loss was in no file. RunDir.write_warm_start keeps it a step; the curves draw it."""
    run = RunDir(tmp_path / "run", tensorboard=False)
    run.write_warm_start([2.5, 1.75, float("nan"), 0.5])
    for s in range(1, 5):
        run.log(_step(s, 0.1))
    run.close()
    from rlmega.rundir.plots import read_warm_start

    got = read_warm_start(tmp_path / "run")
    # NaN kept as a gap (JSON null)
    assert got[:2] == [2.5, 1.75] and math.isnan(got[2]) and got[3] == 0.5
    assert plot_run(tmp_path / "run").exists()
    assert panel_titles([read_metrics(tmp_path / "run")], [got])[-1] == "warm-start loss"
    assert "warm-start loss" not in panel_titles([read_metrics(tmp_path / "run")], [[]])


def test_a_distilling_warm_started_run_draws_seven_panels_on_three_rows(tmp_path):
    """distill_kl (issue 59) gets its own panel; seven no longer fit the two rows of three."""
    run = RunDir(tmp_path / "run", tensorboard=False)
    run.write_warm_start([2.5, 1.0])
    run.log({"step": 0, "eval_accuracy": 0.3})
    for s in range(1, 5):
        run.log(_step(s, 0.1, distill_kl=0.5 / s, eval_accuracy=0.3))
    run.close()
    titles = panel_titles([read_metrics(tmp_path / "run")], [[2.5, 1.0]])
    assert titles == ALL_PANELS[:3] + ["KL to the teachers (distillation)"] + ALL_PANELS[3:] + [
        "warm-start loss"
    ]
    w, h = _png_size(plot_run(tmp_path / "run"))
    assert h > 1.4 * _png_size(plot_run(_write_run(tmp_path / "plain", eval_every=2)))[1]


def test_the_plot_reads_the_metrics_file_anew(tmp_path):
    run = _write_run(tmp_path / "run")  # no evaluation: no accuracy panel
    assert plot_runs([run], run / CURVES) == [
        t for t in ALL_PANELS if t != "held-out greedy reward"
    ]
    first = (run / CURVES).read_bytes()
    # the run goes on and evaluates: the file, not a copy, is drawn
    with open(run / "metrics.jsonl", "a") as f:
        for s in range(13, 25):
            f.write(json.dumps(_step(s, 0.9, eval_accuracy=0.8)) + "\n")
    assert plot_runs([run], run / CURVES) == ALL_PANELS
    assert (run / CURVES).read_bytes() != first


def test_a_live_runs_half_written_last_line_is_left_out(tmp_path):
    run = _write_run(tmp_path / "run", steps=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward_')
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    with open(run / "metrics.jsonl", "a") as f:  # a broken line in the middle is an error naming it
        f.write('\n{"step": 5}\n')
    with pytest.raises(MetricsError, match="line 4 is not JSON"):
        read_metrics(run)


def test_rlmega_plot_overlays_two_runs(tmp_path, monkeypatch, capsys):
    a, b = _write_run(tmp_path / "sync", eval_every=4), _write_run(tmp_path / "async", steps=8)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["plot", str(a), str(b)]) == 0
    _png_size(tmp_path / CURVES)  # several runs: ./curves.png
    # one run evaluated: the panel is there
    assert "held-out greedy reward" in capsys.readouterr().out
    assert (
        cli_main(["plot", str(a), str(b), "--out", str(tmp_path / "cmp" / "sync_vs_async.png")])
        == 0
    )
    _png_size(tmp_path / "cmp" / "sync_vs_async.png")
    assert cli_main(["plot", str(b)]) == 0  # one run: into its folder
    _png_size(b / CURVES)


def test_rlmega_plot_names_a_folder_without_metrics(tmp_path, capsys):
    good = _write_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    assert (
        cli_main(["plot", str(good), str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")])
        == 2
    )
    err = capsys.readouterr().err
    assert f"{tmp_path / 'empty'} has no metrics.jsonl" in err and "Fix:" in err
    assert not (tmp_path / "x.png").exists()  # nothing is written when a run is missing
    assert cli_main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_a_run_that_ends_draws_its_curves_and_a_drawing_failure_hides_nothing(
    tmp_path, monkeypatch, caplog
):
    """rlmega.train.draw_curves, as train() calls it in its finally: a picture when steps were logged,
    nothing for an empty run, and a warning (never an exception) when drawing fails."""
    from rlmega.rundir import plots
    from rlmega.train import draw_curves

    empty = RunDir(tmp_path / "empty", tensorboard=False)
    draw_curves(empty)
    assert not (tmp_path / "empty" / CURVES).exists()
    _write_run(tmp_path / "run", steps=3)
    run = RunDir(tmp_path / "run", tensorboard=False)
    draw_curves(run)
    _png_size(tmp_path / "run" / CURVES)

    def broken(*a, **k):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plots, "plot_runs", broken)
    draw_curves(run)  # logged, not raised
    assert "could not draw" in caplog.text and "RuntimeError: no fonts" in caplog.text
