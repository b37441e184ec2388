"""A run's folder: metrics (JSON lines + TensorBoard), checkpoints, the resolved config.

    RUN_DIR/config.yaml            the resolved config of the run
    RUN_DIR/metrics.jsonl          one JSON object per step, appended and flushed as it happens
    RUN_DIR/tensorboard/           event files of the same numbers
    RUN_DIR/checkpoints/step_N/    complete checkpoints (Megatron dist format + driver state);
    RUN_DIR/checkpoints/latest     written by rename once step_N is complete (checkpoint.py)
    RUN_DIR/hf_final/              the final policy as a Hugging Face folder

On resume the metrics file is rewritten (write, then rename) from the history stored in the
checkpoint, so steps logged after the last checkpoint by a killed run do not appear twice.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _clean(metrics: dict) -> dict:
    """JSON-safe: floats that are not finite become null (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


class RunDir:
    def __init__(self, path: str | Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None):
        self.path = Path(path).absolute()  # workers on other nodes resolve relative paths from another cwd
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.stopped: str | None = None  # why the run ended before trainer.total_steps, if it did
        self._tb = self._tensorboard() if tensorboard else None
        self._wandb = _start_wandb(self.path, wandb_project, config) if wandb_project else None

    def _tensorboard(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.path / "tensorboard"), purge_step=purge_step)

    def write_config(self, text: str) -> None:
        tmp = self.path / "config.yaml.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.path / "config.yaml")

    def log(self, metrics: dict) -> None:
        """Append one step's metrics (must contain "step")."""
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(_clean(metrics), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, metrics["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in _clean(metrics).items() if k != "step"}, step=metrics["step"])

    def rewrite_metrics(self, history: list[dict]) -> None:
        """On resume: the metrics of the steps up to the checkpoint, and nothing after them.

        metrics.jsonl is rewritten (write, then rename); TensorBoard's event files are append-only,
        so a purge marker at the first step after the history hides the killed run's later
        points (SummaryWriter's purge_step), as TensorBoard documents for restarts.
        """
        tmp = self.metrics_path.with_name("metrics.jsonl.tmp")
        with open(tmp, "w") as f:
            for m in history:
                f.write(json.dumps(_clean(m), sort_keys=True) + "\n")
        os.replace(tmp, self.metrics_path)
        if self._tb is not None:
            self._tb.close()
            self._tb = self._tensorboard(purge_step=1 + max((m["step"] for m in history), default=0))

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def latest_checkpoint(self) -> Path | None:
        pointer = self.checkpoints / "latest"
        if not pointer.exists():
            return None
        path = self.checkpoints / pointer.read_text().strip()
        return path if path.is_dir() else None

    def checkpoint_to_resume(self, resume: str) -> Path | None:
        """trainer.resume -> the checkpoint to start from: "none" -> None; "auto" -> this run's
        latest (None if it has none); any other value is a path, resolved by ``find_checkpoint``,
        and wins over this run's own checkpoints."""
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest_checkpoint()
        return find_checkpoint(resume)

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` complete checkpoints (never the latest one)."""
        latest = self.latest_checkpoint()
        steps = sorted(p for p in self.checkpoints.iterdir() if _STEP_DIR.match(p.name)) if self.checkpoints.exists() else []
        doomed = [p for p in steps[:-keep] if p != latest] if keep > 0 else []
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder from a step folder or a checkpoints root (its ``latest``).

    Raises FileNotFoundError saying what is wrong. Filesystem only (config validation uses it
    before any worker starts): complete means Megatron's ``metadata.json`` was written and the
    folder is not a ``.partial`` save.
    """
    path = Path(path)
    if (path / "latest").is_file():
        name = (path / "latest").read_text().strip()
        if not (path / name).is_dir():
            raise FileNotFoundError(f"{path}/latest names {name!r}, which is not a folder there")
        path = path / name
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder")
    if path.name.endswith(".partial"):
        raise FileNotFoundError(f"{path} is an unfinished save (.partial); use the step folder beside it")
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no metadata.json); give a checkpoints/step_N "
                                "folder or a checkpoints folder with a `latest` file")
    return path


def _start_wandb(path: Path, project: str, config: dict | None):
    """A wandb run that a resumed run continues (its id is kept in the run folder).

    WANDB_MODE=offline (no network) writes it under RUN_DIR/wandb for a later `wandb sync`.
    """
    try:
        import wandb
    except ImportError:
        raise RuntimeError(f"logging.wandb_project={project!r} needs wandb: pip install wandb "
                           "(or unset logging.wandb_project)") from None
    id_file = path / "wandb_run_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return wandb.init(project=project, dir=str(path), id=id_file.read_text().strip(), resume="allow",
                      config=config, name=path.name)
