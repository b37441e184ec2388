"""torch profiler traces of chosen RL steps: ``logging.profile_steps=[2,3]``.

For each listed step every trainer rank writes ``RUN_DIR/profile/step_N/trainer_rank{R}.json`` and every
rollout engine writes vLLM's own trace (its engine loop and model runner) under
``RUN_DIR/profile/step_N/``. Chrome trace format: open them in https://ui.perfetto.dev or
chrome://tracing. The driver's own phases are in metrics.jsonl (time_*).

    with profiled(roles, run.path / "profile", step=3, steps=cfg.logging.profile_steps):
        metrics = rl_step(...)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch


class TraceRecorder:
    """One process's torch profiler, started and stopped by calls (a trainer rank holds one)."""

    def __init__(self):
        self._prof = None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()

    def stop(self, path: str | Path) -> str:
        """End the trace and write it to ``path`` (write, then rename: never a half-written trace)."""
        if self._prof is None:
            raise RuntimeError("stop() without start(): no trace is being recorded")
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        return str(path)


@contextmanager
def profiled(roles, root: Path, step: int, steps: list[int]):
    """Trace every rank and engine during the block when ``step`` is one of ``steps``."""
    if step not in steps:
        yield
        return
    out = Path(root).resolve() / f"step_{step}"
    roles.start_profile(f"step_{step}")
    try:
        yield
    finally:
        roles.stop_profile(str(out))
