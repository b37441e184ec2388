"""Which checkpoint a resume starts from (issue 22 items 1, 2, 4): the newest *complete* one, judged by
the driver before any worker loads it, with a log line when that is not the one `latest` names; an
error naming what was found when none is complete; resume=none refuses a folder holding a run.

The checkpoints are real torch DCP folders (one process, no_dist) with Megatron's metadata.json and a
common.pt, the files rlmega/megatron/checkpoint.py writes; damage is done to real files.
"""

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rlmega.rundir.checkpoint_scan import problem
from rlmega.rundir.run import ResumeError, RunDir, changed_settings, find_checkpoint


def _checkpoint(root: Path, step: int, settings: dict | None = None) -> Path:
    from rlmega.rundir import shard_checksums

    d = root / f"step_{step:08d}"
    dcp.save({"w": torch.arange(4096.0) + step}, checkpoint_id=str(d), no_dist=True)
    torch.save({"meta": {"step": step, "extra": {"settings": settings or {}}}}, d / "common.pt")
    # as a save does
    shard_checksums.write(d, shard_checksums.digest(d, [p.name for p in d.glob("*.distcp")]))
    (d / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )
    (root / "latest").write_text(d.name)
    return d


def _shard(d: Path) -> Path:
    return next(d.glob("*.distcp"))


def _truncate(f: Path, keep: int) -> None:
    f.write_bytes(f.read_bytes()[:keep])


def _flip(f: Path, at: int) -> None:
    """One bit changed at byte ``at``; the file keeps its length (what a size check alone lets through)."""
    data = bytearray(f.read_bytes())
    data[at] ^= 1
    f.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path):
    r = RunDir(tmp_path / "run", tensorboard=False)
    for step in (2, 4):
        _checkpoint(r.checkpoints, step)
    return r


DAMAGE = {
    "shard truncated": (lambda d: _truncate(_shard(d), 100), "truncated (100 of"),
    "shard missing": (lambda d: _shard(d).unlink(), "missing"),
    "a byte flipped in a shard": (lambda d: _flip(_shard(d), 100), "damaged (its sha256 differs"),
    "checksums.json garbled": (
        lambda d: (d / "checksums.json").write_text("{"),
        "checksums.json unreadable",
    ),
    "common.pt truncated": (lambda d: _truncate(d / "common.pt", 50), "common.pt unreadable"),
    "common.pt missing": (lambda d: (d / "common.pt").unlink(), "common.pt missing"),
    "index missing": (lambda d: (d / ".metadata").unlink(), ".metadata"),
    "metadata.json missing": (lambda d: (d / "metadata.json").unlink(), "no metadata.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_auto_falls_back_past_a_damaged_latest_and_says_so(run, damage, caplog):
    # Before: a truncated or missing shard failed inside every worker on every --resume, forever.
    spoil, words = DAMAGE[damage]
    spoil(run.checkpoints / "step_00000004")
    assert words in problem(run.checkpoints / "step_00000004")
    with caplog.at_level(logging.WARNING, logger="rlmega"):
        assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000002"
    assert (
        "step_00000002" in caplog.text and "step_00000004" in caplog.text and words in caplog.text
    )
    assert "trainer.resume=" in caplog.text  # how to pick another one by name


@pytest.mark.parametrize("pointer", ["missing", "empty", "dangling"])
def test_auto_resumes_the_newest_complete_checkpoint_whatever_latest_says(run, pointer, caplog):
    # Before: a missing, empty or dangling `latest` started the run over at step 0 (metrics repeated).
    latest = run.checkpoints / "latest"
    {
        "missing": latest.unlink,
        "empty": lambda: latest.write_text(""),
        "dangling": lambda: latest.write_text("step_00000006"),
    }[pointer]()
    with caplog.at_level(logging.WARNING, logger="rlmega"):
        assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000004"
    assert "step_00000004" in caplog.text


def test_a_complete_latest_wins_over_a_newer_step_folder(run):
    # step 6 may be an abandoned branch: this folder resumed from step 4 by name after a run reached 6
    _checkpoint(run.checkpoints, 6)
    (run.checkpoints / "latest").write_text("step_00000004")
    assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000004"
    # a damaged latest: the newest complete one
    _truncate(_shard(run.checkpoints / "step_00000004"), 100)
    assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000006"


def test_auto_stops_naming_what_it_found_when_nothing_is_complete(run):
    _truncate(_shard(run.checkpoints / "step_00000002"), 10)
    (run.checkpoints / "step_00000004" / "common.pt").unlink()
    with pytest.raises(ResumeError) as e:
        run.checkpoint_to_resume("auto")
    msg = str(e.value)
    assert (
        "step_00000002: shard" in msg
        and "step_00000004: common.pt missing" in msg
        and "Fix:" in msg
    )


def test_auto_stops_when_latest_names_a_checkpoint_and_none_is_left(tmp_path):
    r = RunDir(tmp_path / "run", tensorboard=False)
    r.checkpoints.mkdir()
    (r.checkpoints / "latest").write_text("step_00000004")
    with pytest.raises(
        ResumeError, match="latest names step_00000004, but no checkpoint folder is left"
    ):
        r.checkpoint_to_resume("auto")


def test_auto_starts_fresh_where_nothing_was_saved(tmp_path):
    r = RunDir(tmp_path / "run", tensorboard=False)
    # a first save that never finished
    (r.checkpoints / "step_00000002.partial").mkdir(parents=True)
    assert r.checkpoint_to_resume("auto") is None


def test_a_named_damaged_checkpoint_is_refused_with_a_complete_one_named(run):
    _truncate(_shard(run.checkpoints / "step_00000004"), 100)
    with pytest.raises(
        FileNotFoundError,
        match=r"cannot be resumed from: shard .* truncated .*e\.g\. .*step_00000002",
    ):
        find_checkpoint(run.checkpoints / "step_00000004")
    with pytest.raises(ResumeError, match="trainer.resume="):
        run.checkpoint_to_resume(str(run.checkpoints / "step_00000004"))
    # a checkpoints folder: its newest complete step
    assert find_checkpoint(run.checkpoints) == run.checkpoints / "step_00000002"


def test_resume_none_refuses_a_folder_that_holds_a_run(run, tmp_path):
    # Before: resume=none appended to the earlier run's metrics (steps 1, 2, 1) and overwrote its checkpoints.
    run.log({"step": 1, "loss": 0.5})
    with pytest.raises(ResumeError) as e:
        run.checkpoint_to_resume("none")
    msg = str(e.value)
    assert "1 lines in metrics.jsonl" in msg and "step_00000002, step_00000004" in msg
    assert "--resume" in msg and "new trainer.run_dir" in msg
    assert RunDir(tmp_path / "fresh", tensorboard=False).checkpoint_to_resume("none") is None


def test_a_resume_says_which_settings_changed(run):
    d = _checkpoint(run.checkpoints, 6, settings={"optimizer.lr": 1e-5, "trainer.total_steps": 4})
    now = {"optimizer.lr": 2e-5, "trainer.total_steps": 4, "optimizer.min_lr": 0.0}
    assert changed_settings(d, now) == ["optimizer.lr: 1e-05 -> 2e-05"]
    # no record: nothing claimed
    assert changed_settings(run.checkpoints / "step_00000002", now) == []
    # the distributed optimizer's state does not load into the plain one, nor the reverse: refused by name
    d = _checkpoint(run.checkpoints, 8, settings={"optimizer.use_distributed_optimizer": True})
    with pytest.raises(
        ResumeError, match=r"optimizer.use_distributed_optimizer=True \(the optimizer state"
    ):
        changed_settings(d, {"optimizer.use_distributed_optimizer": False})
    # distillation (issue 59): another teacher, or one added to a run that had none, is refused by name
    teacher = [{"path": "/models/t", "identity": "ab12", "weight": 1.0, "tasks": []}]
    d = _checkpoint(run.checkpoints, 10, settings={"distillation.teachers": teacher})
    other = [{**teacher[0], "identity": "cd34"}]
    with pytest.raises(
        ResumeError, match=r"distillation.teachers=.*ab12.* \(the run distils from them\)"
    ):
        changed_settings(d, {"distillation.teachers": other})
    assert changed_settings(d, {"distillation.teachers": teacher}) == []
    d = _checkpoint(run.checkpoints, 12, settings={"distillation.teachers": []})
    with pytest.raises(
        ResumeError,
        match="this run has distillation.teachers=.*cd34.*Fix: set distillation.teachers as saved",
    ):
        changed_settings(d, {"distillation.teachers": other})


def test_saving_over_a_step_keeps_a_complete_checkpoint_through_a_crash(run, monkeypatch):
    # Before: step_N was rmtree'd before the new one was renamed in; a crash in between left `latest`
    # naming nothing and the old data gone. Now the old folder is renamed aside first.
    from rlmega.megatron import checkpoint

    final = run.checkpoints / "step_00000004"
    partial = _checkpoint(run.checkpoints, 99).rename(run.checkpoints / "step_00000004.partial")
    (run.checkpoints / "latest").write_text(final.name)
    real_rename = Path.rename

    def crash_on_the_second_rename(self, target):
        if self.name.endswith(".partial"):
            raise OSError("power lost")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_the_second_rename)
    with pytest.raises(OSError, match="power lost"):
        checkpoint._move_into_place(partial, final)
    monkeypatch.undo()
    # the old save is still whole
    assert problem(run.checkpoints / "step_00000004.replaced") is None
    assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000002"
    checkpoint._move_into_place(partial, final)  # the next save of that step goes through
    assert problem(final) is None and torch.load(final / "common.pt")["meta"]["step"] == 99


def test_a_refused_fresh_start_leaves_the_held_folder_untouched(run, tmp_path):
    # a second trainer started by mistake (resume=none, the default) on a folder whose run is writing:
    # refused before anything opens the folder, so its half-written last line and files stay as they are
    from rlmega.config.schema import RLConfig
    from rlmega.train import train

    run.metrics_path.write_text('{"step": 1}\n{"step": 2, "lo')
    before = sorted(p.name for p in run.path.rglob("*"))
    cfg = RLConfig()
    cfg.trainer.run_dir, cfg.trainer.resume = str(run.path), "none"
    with pytest.raises(ResumeError, match="already holds a run"):
        train(cfg)
    assert run.metrics_path.read_text() == '{"step": 1}\n{"step": 2, "lo'
    assert sorted(p.name for p in run.path.rglob("*")) == before


def _fsdp_checkpoint(root: Path, step: int) -> Path:
    """The files rlmega/fsdp/checkpoint.py writes: plain DCP and a common.pt saying backend=fsdp."""
    d = root / f"step_{step:08d}"
    dcp.save({"w": torch.arange(4096.0) + step}, checkpoint_id=str(d), no_dist=True)
    torch.save(
        {"meta": {"backend": "fsdp", "step": step, "extra": {"settings": {}}}}, d / "common.pt"
    )
    (root / "latest").write_text(d.name)
    return d


FSDP_DAMAGE = {
    "shard truncated": (lambda d: _truncate(_shard(d), 100), "truncated (100 of"),
    "index missing": (lambda d: (d / ".metadata").unlink(), ".metadata"),
    "common.pt missing": (
        lambda d: (d / "common.pt").unlink(),
        "no metadata.json (Megatron) or common.pt",
    ),
    "common.pt truncated": (lambda d: _truncate(d / "common.pt", 50), "common.pt unreadable"),
}


@pytest.mark.parametrize("damage", FSDP_DAMAGE)
def test_fsdp_checkpoints_resume_fall_back_and_prune_like_megatrons(tmp_path, damage):
    # issue 23: a DCP checkpoint of the FSDP backend has no metadata.json; without the fsdp rule every
    # one of them counted as incomplete, so a resume started over at step 0.
    run = RunDir(tmp_path / "run", tensorboard=False)
    for step in (2, 4, 6):
        _fsdp_checkpoint(run.checkpoints, step)
    assert problem(run.checkpoints / "step_00000006") is None
    assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000006"
    assert changed_settings(run.checkpoints / "step_00000006", {"optimizer.lr": 1.0}) == []
    spoil, words = FSDP_DAMAGE[damage]
    spoil(run.checkpoints / "step_00000006")
    assert words in problem(run.checkpoints / "step_00000006")
    assert run.checkpoint_to_resume("auto") == run.checkpoints / "step_00000004"
    (run.checkpoints / "latest").write_text("step_00000004")
    # never the latest (4)
    assert [p.name for p in run.prune_checkpoints(keep=1)] == ["step_00000002"]


def test_resume_auto_refuses_a_lora_checkpoint_for_a_full_run_at_load(run):
    """`rlmega train CONFIG --resume` (trainer.resume=auto) into a run folder whose newest checkpoint holds LoRA
    adapters, with actor.lora.rank=0: refused by the config checks, naming trainer.resume, before the run folder
    changes (it used to fail in a worker ~28 s later, after config.yaml was overwritten)."""
    from rlmega.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[2]
    lora = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"]}
    d = _checkpoint(run.checkpoints, 6)
    torch.save({"meta": {"step": 6, "extra": {"settings": {}}, "lora": lora}}, d / "common.pt")
    before = sorted(p.name for p in run.path.rglob("*"))
    overrides = [f"trainer.run_dir={run.path}", "trainer.resume=auto"]
    with pytest.raises(ConfigError, match=r"trainer.resume.*LoRA run's adapters"):
        load_config(root / "configs/tiny_cpu.yaml", overrides)
    assert sorted(p.name for p in run.path.rglob("*")) == before
    # auto takes the complete full-parameter step 4
    (run.checkpoints / "latest").write_text("step_00000004")
    # only the model folder this test does not make is left
    with pytest.raises(ConfigError) as other:
        load_config(root / "configs/tiny_cpu.yaml", overrides)
    assert "trainer.resume" not in str(other.value) and "model.path" in str(other.value)
