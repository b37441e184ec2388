"""Fault injection for tests: wrappers that break one thing on purpose."""
from __future__ import annotations


class CorruptingTransport:
    """Passes buckets on, but adds ``delta`` to one named tensor in transit."""

    def __init__(self, inner, tensor_name: str, delta: float = 0.05):
        self.inner, self.tensor_name, self.delta = inner, tensor_name, delta

    def send(self, bucket, version: int) -> None:
        bucket = [(n, t + self.delta if n == self.tensor_name else t) for n, t in bucket]
        self.inner.send(bucket, version)

    def flush(self) -> None:
        self.inner.flush()


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


def main_with_a_skipped_sync(argv: list[str]) -> int:
    """``python -m rlmega.testing.faults VERSION CONFIG [key=value ...]``: rlmega train, the sync of VERSION
    skipped (tests/e2e/test_train.py: the parity guard must stop the run)."""
    from rlmega.train import main

    skip_weight_sync(int(argv[0]))
    return main(argv[1:])


if __name__ == "__main__":
    import sys

    sys.exit(main_with_a_skipped_sync(sys.argv[1:]))
