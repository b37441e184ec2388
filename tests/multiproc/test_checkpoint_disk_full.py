"""A checkpoint that fills the disk (issue 10): a clear error with the path, no half-written folder, and
`latest` still naming the last good checkpoint. On a real tmpfs sized to hold one checkpoint, not two.

Needs root (mount); skipped with the reason otherwise.
"""

import os
import subprocess

import pytest

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model


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


def _actor(path):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=path),
        ParallelismConfig(1, 1, None, 2),
        OptimizerConfig(lr=1e-3),
        ActorConfig(max_tokens_per_micro_batch=64),
        AlgorithmConfig(),
    )
    actor.setup(with_reference=False)
    actor.sft_step(random_batch(8, seed=1))  # Adam state exists: the checkpoint has its full size
    return actor


def _size_body(path, root):
    actor = _actor(path)
    out = actor.save_checkpoint(root, 1)
    actor.teardown()
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)


def _full_body(path, root):
    from rlmega.megatron.checkpoint import CheckpointSpaceError

    actor = _actor(path)
    actor.save_checkpoint(root, 1)
    actor.sft_step(random_batch(8, seed=2))
    try:
        actor.save_checkpoint(root, 2)
        error = None
    except CheckpointSpaceError as e:
        error = str(e)
    actor.teardown()
    return error


def test_disk_full_at_a_checkpoint_keeps_the_last_good_one(hf_model, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    size = run_on_ranks(_size_body, 2, args=(hf_model, str(tmp_path / "measure")), timeout_s=300)[0]
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    limit = int(size * 1.6) // 4096 * 4096 + 4096  # room for one checkpoint, not two
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        root = mnt / "checkpoints"
        errors = run_on_ranks(_full_body, 2, args=(hf_model, str(root)), timeout_s=300)
        names = sorted(p.name for p in root.iterdir())
        latest = (root / "latest").read_text().strip()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    assert all(e is not None for e in errors), errors  # every rank got the same clear error
    msg = errors[0]
    assert "no space left on device" in msg and str(root / "step_00000002.partial") in msg, msg
    assert "step_00000001" in msg and "Fix:" in msg
    assert names == ["latest", "step_00000001"], names  # no .partial left behind
    assert latest == "step_00000001"
