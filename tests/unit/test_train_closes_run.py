"""The driver closes its run folder's writers (TensorBoard, wandb) however it ends (issue 22 item 18)."""

import threading

import pytest

from rlmega.config.schema import RLConfig
from rlmega.demo.tiny_model import make_tiny_model


def test_train_closes_the_tensorboard_writer_when_it_fails(tmp_path):
    from rlmega.train import InputError, train

    model = make_tiny_model(
        tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=1
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{this is not json\n")
    cfg = RLConfig()
    cfg.model.path, cfg.data.train_path = str(model), str(bad)
    cfg.trainer.run_dir, cfg.logging.tensorboard = str(tmp_path / "run"), True
    before = set(threading.enumerate())
    # fails after the run folder opened its writer
    with pytest.raises(InputError, match="prompt data"):
        train(cfg)
    # an open SummaryWriter keeps its event-file writer thread alive; a closed one has joined it
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], left
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))  # it was opened
