"""tools/bench/megatron_mfu.py --smoke: a real Megatron train step and its MFU, on this CPU, in seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mfu_smoke_runs_and_reports_a_sane_mfu(tmp_path):
    out = tmp_path / "mfu.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(k, None)
    prof = tmp_path / "kernels.txt"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/megatron_mfu.py"),
            "--smoke",
            "--json",
            str(out),
            "--profile",
            str(prof),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "MFU" in proc.stdout
    table = prof.read_text()  # --profile: one more step's ops by self time
    assert table.startswith("one step, cpu") and "aten::mm" in table and "Self CPU" in table, table[
        :2000
    ]
    # The formula's N is the model's own parameter count minus the input embedding (256 x 64).
    assert r["counted_params"] == r["params"] - 256 * 64
    losses = r["losses"]
    assert losses[-1] < losses[0]  # the optimizer really steps
    assert 0 < r["mfu_vs_matmul_peak"] <= 1.0, r
    assert r["datasheet_tflops"] is None  # no datasheet peak for a CPU


def test_mfu_smoke_of_the_fsdp_backend_measures_the_same_shape_the_same_way(tmp_path):
    """--backend fsdp: the same tiny shape, tokens and formula through FSDPModelManager (one-rank gloo)."""
    out = tmp_path / "mfu_fsdp.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/megatron_mfu.py"),
            "--smoke",
            "--backend",
            "fsdp",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["backend"] == "fsdp" and "fsdp on cpu" in proc.stdout and "MFU" in proc.stdout
    # HF's parameter count (DTensors report their full shape) is Megatron's: the formula's N plus the embedding.
    assert r["counted_params"] == r["params"] - 256 * 64
    assert r["losses"][-1] < r["losses"][0]  # the optimizer really steps
    assert 0 < r["mfu_vs_matmul_peak"] <= 1.0, r
