"""Fault injection for tests: wrappers that break one thing on purpose."""

from __future__ import annotations

import dataclasses

from rlmega.sync.pieces import Piece


class CorruptingTransport:
    """Passes buckets on, but adds ``delta`` to one named tensor in transit (to each TP rank's block of
    it when the inner transport takes pieces, rlmega/sync/pieces.py)."""

    def __init__(self, inner, tensor_name: str, delta: float = 0.05):
        self.inner, self.tensor_name, self.delta = inner, tensor_name, delta
        self.takes_pieces = getattr(inner, "takes_pieces", False)

    def send(self, bucket, version: int) -> None:
        bucket = [(n, _shifted(t, self.delta) if n == self.tensor_name else t) for n, t in bucket]
        self.inner.send(bucket, version)

    def flush(self) -> None:
        self.inner.flush()


def _shifted(t, delta: float):
    return dataclasses.replace(t, tensor=t.tensor + delta) if isinstance(t, Piece) else t + delta


def skip_weight_sync(version_to_skip: int) -> None:
    """Patch Roles so that the sync of ``version_to_skip`` sends no tensor and only stamps the engines
    with the version: the engines keep sampling from the older weights while the trainer moves on."""
    import ray

    from rlmega.launch.roles import Roles

    real = Roles._send_weights

    def send(self, version: int, bucket_bytes: int) -> dict:
        if version != version_to_skip:
            return real(self, version, bucket_bytes)
        ray.get([e.update_weights.remote([], version) for e in self.engines])
        return {"bytes": 0, "seconds": 0.0}

    Roles._send_weights = send


def hang_after_step(step: int) -> None:
    """Patch RunDir so that the driver blocks for good right after it logs ``step``: a kill -9 test then
    kills a driver that finished exactly that step and started no other (no race between the test's
    poll of metrics.jsonl and a fast next step, or its checkpoint)."""
    import time

    from rlmega.rundir.run import RunDir

    real = RunDir.log

    def log(self, metrics: dict) -> None:
        real(self, metrics)
        if metrics.get("step") == step:
            while True:
                time.sleep(3600)

    RunDir.log = log


def main(argv: list[str]) -> int:
    """``python -m rlmega.testing.faults FAULT N CONFIG [key=value ...]``: rlmega train with one fault.
    FAULT ``skip-sync``: the sync of version N sends nothing (tests/e2e/test_train.py: the parity guard
    must stop the run); ``hang-after``: the driver blocks after logging step N (the kill -9 resume tests)."""
    from rlmega.train import main as train_main

    fault, n = argv[0], int(argv[1])
    {"skip-sync": skip_weight_sync, "hang-after": hang_after_step}[fault](n)
    return train_main(argv[2:])


if __name__ == "__main__":
    import sys

    from rlmega.launch.process_exit import leave

    leave(main(sys.argv[1:]))
