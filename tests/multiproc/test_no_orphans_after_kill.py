"""A trainer rank killed with -9 after it saved a checkpoint leaves no process behind (issue 22, item 6).

The rank is a plain process (as under torchrun: no Ray raylet to reap what it started), world 1, a tiny
Qwen2 with Adam state. Megatron's checkpoint writer used to start a multiprocessing Manager (and the
resource tracker) there, which outlived the kill re-parented to init. The kill of the driver of a whole
run is tests/e2e/test_train.py::test_kill_9_and_resume_matches_an_uninterrupted_run.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlmega.testing.multiproc import free_port
from rlmega.demo.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import sys
from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.testing.batches import random_batch
from rlmega.megatron.actor import MegatronActor

actor = MegatronActor(ModelConfig(path=sys.argv[1]), ParallelismConfig(1, 1, None, 1), OptimizerConfig(lr=1e-3),
                      ActorConfig(max_tokens_per_micro_batch=64), AlgorithmConfig())
actor.setup(with_reference=False)
actor.sft_step(random_batch(8, seed=1))
actor.save_checkpoint(sys.argv[2], 1)
print("saved", flush=True)
sys.stdin.read()  # until killed
"""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=2,
            seed=3,
        )
    )


def test_a_rank_killed_after_a_checkpoint_leaves_no_process(hf_model, tmp_path):
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, hf_model, str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = rank.stdout.readline()
        assert line.strip() == "saved", f"the rank ended before saving (exit {rank.wait()})"
        # what the rank started, recorded before the kill
        tree = psutil.Process(rank.pid).children(recursive=True)
        rank.send_signal(signal.SIGKILL)
        rank.wait()
    finally:
        if rank.poll() is None:
            rank.kill()
    assert (tmp_path / "ckpt" / "latest").exists()
    # psutil's is_running also tells a reused pid from the one recorded
    deadline = time.monotonic() + 5.0
    while (left := [p for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = [" ".join(p.cmdline())[:100] for p in left]
    for p in left:  # a failing run still cleans up after itself
        p.kill()
    assert not left, f"left behind by a killed rank: {names}"
