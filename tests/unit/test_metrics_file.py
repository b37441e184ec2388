"""metrics.jsonl survives a write cut short and a crash during its rewrite (issue 22 item 3)."""

import logging
import os

import pytest

from rlmega.rundir.run import RunDir


def test_a_half_written_last_line_is_cut_back_on_open(tmp_path, caplog):
    # Before: the next step was glued onto the half line, and read_metrics then raised.
    run = RunDir(tmp_path, tensorboard=False)
    run.log({"step": 1, "loss": 0.5})
    run.close()
    with open(run.metrics_path, "a") as f:
        f.write('{"loss": 0.25, "st')  # the disk filled up mid-line
    with caplog.at_level(logging.WARNING, logger="rlmega"):
        again = RunDir(tmp_path, tensorboard=False)
    assert "half-written line (18 bytes" in caplog.text and "1 complete lines kept" in caplog.text
    again.log({"step": 2, "loss": 0.25})
    assert again.read_metrics() == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_an_intact_file_is_left_alone(tmp_path, caplog):
    run = RunDir(tmp_path, tensorboard=False)
    run.log({"step": 1, "loss": 0.5})
    before = run.metrics_path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="rlmega"):
        RunDir(tmp_path, tensorboard=False)
    assert run.metrics_path.read_bytes() == before and not caplog.text


def test_a_bad_line_is_named(tmp_path):
    run = RunDir(tmp_path, tensorboard=False)
    run.metrics_path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        run.read_metrics()


def test_rewrite_is_fsynced_file_and_folder(tmp_path, monkeypatch):
    # A rename is durable only once its folder is fsynced, the file's bytes only once it was: record
    # what the real os.fsync is called on (power loss cannot be staged in a test).
    run = RunDir(tmp_path, tensorboard=False)
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    run.rewrite_metrics([{"step": 1, "loss": 0.5}])
    assert synced == [str(tmp_path / "metrics.jsonl.tmp"), str(tmp_path)]
    assert (
        run.read_metrics() == [{"step": 1, "loss": 0.5}]
        and not (tmp_path / "metrics.jsonl.tmp").exists()
    )
