"""tools/slurm/rlmega.sbatch without Slurm: it parses, lints clean where shellcheck is installed, and
refuses to run outside a job with a message that says how to submit it. The real runs are in
tests/e2e/test_slurm.py."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rlmega.launch.wait_cluster import missing_hosts

SBATCH = Path(__file__).resolve().parents[2] / "tools" / "slurm" / "rlmega.sbatch"


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(
    not shutil.which("shellcheck"),
    reason="shellcheck is not installed (apt-get install shellcheck)",
)
def test_the_script_lints_clean():
    out = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_outside_a_job_it_says_how_to_submit():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        ["bash", str(SBATCH), "configs/tiny_cpu.yaml"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert "sbatch tools/slurm/rlmega.sbatch CONFIG" in out.stderr


def test_missing_hosts_compares_short_names():
    assert missing_hosts(["n1", "n2.cluster", "n3"], ["n1.cluster", "n2"]) == ["n3"]
    assert missing_hosts(["n1"], ["n1"]) == []


def test_it_pauses_without_a_sleep_process():
    """A `sleep` child of the job script was found alive after its cancelled job was gone
    (tests/e2e/test_slurm.py); the script naps with `read -t` instead, which starts no process."""
    text = SBATCH.read_text()
    assert not re.search(r"^[^#]*\bsleep\b", text, re.M), (
        "the script starts a sleep process: use nap"
    )
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("{ exec {nap_fd}"))
    last = next(i for i, line in enumerate(lines) if line.startswith("nap()"))
    nap = lines[first : last + 1]  # the pipe (or its FIFO fallback) and the function
    start = time.monotonic()
    out = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + "\n".join(nap) + "\nnap 0.5\nnap 0.5\necho done"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout == "done\n" and 0.9 < time.monotonic() - start < 5, (
        out,
        time.monotonic() - start,
    )
