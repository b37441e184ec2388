"""The `rlmega` command as a user runs it: a real subprocess of the installed console script."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

RLMEGA = shutil.which("rlmega", path=str(Path(sys.executable).parent)) or "rlmega"


def _run(*args, timeout=300):
    return subprocess.run(
        [RLMEGA, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_check_config_prints_the_resolved_config(tiny_model, tmp_path):
    out = _run(
        "check-config",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={tiny_model}",
        "trainer.total_steps=7",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"total_steps: 7\b", out.stdout)
    # check-config also checks the config can run here (preflight): a model folder must be given
    out = _run("check-config", str(ROOT / "configs/tiny_cpu.yaml"), "model.path=''")
    assert out.returncode == 2 and "model.path: is not set" in out.stderr, out.stderr


def test_check_config_rejects_a_bad_field_with_exit_2():
    out = _run(
        "check-config",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "model.path=''",
        "trainer.total_stepz=7",
    )
    assert out.returncode == 2
    assert "trainer.total_stepz" in out.stderr and "trainer.total_steps" in out.stderr


@pytest.mark.timeout(400)
def test_lm_demo_trains_megatron_tp2_pp2(tiny_model):
    """The plain language-model run (torchrun, 4 ranks): Megatron's whole training stack learns."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "rlmega.megatron.lm_demo",
        "--model",
        tiny_model,
        "--steps",
        "8",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=360,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "TP2 x PP2" in out.stdout
    losses = [float(x) for x in re.findall(r"step +\d+/8 +loss ([\d.]+)", out.stdout)]
    assert len(losses) == 8
    start, end = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert end < start - 0.5, (start, end)  # it learns, not just runs
