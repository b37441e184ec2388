"""RunDir: metrics lines, rewrite on resume, checkpoint pruning, TensorBoard and wandb (offline)."""

import time
from pathlib import Path

import pytest
import torch

from rlmega.rundir.run import ResumeError, RunDir


def test_metrics_log_rewrite_and_nan(tmp_path):
    run = RunDir(tmp_path / "r", tensorboard=True)
    run.log({"step": 1, "loss": 0.5})
    run.log({"step": 2, "loss": float("nan")})
    # JSON has no NaN
    assert run.read_metrics() == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]
    run.rewrite_metrics([{"step": 1, "loss": 0.5}])  # a resume drops steps past the checkpoint
    assert run.read_metrics() == [{"step": 1, "loss": 0.5}]
    run.close()
    assert list((tmp_path / "r" / "tensorboard").iterdir())


def test_prune_keeps_the_newest_and_never_the_latest(tmp_path):
    run = RunDir(tmp_path, tensorboard=False)
    for step in (2, 4, 6):
        (run.checkpoints / f"step_{step:08d}").mkdir(parents=True)
    (run.checkpoints / "latest").write_text("step_00000006")
    (run.checkpoints / "step_00000008.partial").mkdir()  # an interrupted save is not counted
    removed = run.prune_checkpoints(keep=2)
    assert [p.name for p in removed] == ["step_00000002"]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [
        "latest",
        "step_00000004",
        "step_00000006",
        "step_00000008.partial",
    ]


def test_wandb_offline_run_gets_the_metrics_and_resumes_the_same_id(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(
        tmp_path,
        tensorboard=False,
        wandb_project="rlmega-test",
        config={"trainer": {"total_steps": 2}},
    )
    run.log({"step": 1, "reward_mean": 0.25})
    run.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and list(runs[0].glob("*.wandb")), "no offline wandb run written"
    # a resumed run: same id
    again = RunDir(tmp_path, tensorboard=False, wandb_project="rlmega-test")
    assert again._wandb.id == run_id
    again.close()
    assert wandb.run is None


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    import torch.distributed.checkpoint as dcp

    # the shards and their index
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
    # what Megatron's dist checkpointing writes last
    (d / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )
    torch.save({"meta": {"step": step, "extra": {}}}, d / "common.pt")  # rank 0's plain state
    return d


def test_resume_picks_the_named_checkpoint_over_the_run_dirs_latest(tmp_path):
    # Issue 9: asked for step 15 in a run dir whose latest is 17, the run resumed at 17.
    run = RunDir(tmp_path / "run", tensorboard=False)
    s15, s17 = _fake_checkpoint(run.checkpoints, 15), _fake_checkpoint(run.checkpoints, 17)
    (run.checkpoints / "latest").write_text(s17.name)
    assert run.checkpoint_to_resume(str(s15)) == s15
    assert run.checkpoint_to_resume("auto") == s17
    # a fresh start would mix two runs
    with pytest.raises(ResumeError, match="already holds a run"):
        run.checkpoint_to_resume("none")
    # another run's checkpoint, a fresh run dir
    other = RunDir(tmp_path / "other", tensorboard=False)
    assert other.checkpoint_to_resume(str(s15)) == s15
    assert other.checkpoint_to_resume(str(run.checkpoints)) == s17  # a checkpoints root: its latest
    assert other.checkpoint_to_resume("auto") is None


def _tensorboard_steps(path: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    # Issue 10: the killed run's steps 4-5 stayed in the event files, so steps 4 and 5 showed twice.
    run = RunDir(tmp_path / "r", tensorboard=True)
    for step in range(1, 6):
        run.log({"step": step, "loss": float(step)})
    run.close()  # killed after step 5; the last checkpoint is at step 3
    # TensorBoard orders event files by name (start second, then a per-process counter that sorts as
    # text): a real resume starts seconds later, so wait past the second to model that.
    time.sleep(1.1)
    resumed = RunDir(tmp_path / "r", tensorboard=True)
    resumed.rewrite_metrics([{"step": s, "loss": float(s)} for s in range(1, 4)])
    for step in (4, 5):
        resumed.log({"step": step, "loss": 10.0 * step})
    resumed.close()
    assert _tensorboard_steps(tmp_path / "r", "loss") == [1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [1.0, 2.0, 3.0, 40.0, 50.0]
