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
