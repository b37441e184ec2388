"""A run's folder: metrics (JSON lines + TensorBoard), checkpoints, the resolved config.

    RUN_DIR/config.yaml            the resolved config of the run
    RUN_DIR/metrics.jsonl          one JSON object per step, appended and flushed as it happens
    RUN_DIR/tensorboard/           event files of the same numbers
    RUN_DIR/checkpoints/step_N/    complete checkpoints (Megatron dist format + driver state);
    RUN_DIR/checkpoints/latest     written by rename once step_N is complete (checkpoint.py)
    RUN_DIR/hf_final/              the final policy as a Hugging Face folder

On resume the metrics file is rewritten (write, fsync, rename, fsync the folder) from the history
stored in the checkpoint, so steps logged after the last checkpoint by a killed run do not appear
twice. A metrics file cut inside a line (disk full, power loss) is cut back to its last newline when
the run folder is opened. trainer.resume=auto resumes from the checkpoint `latest` names when it is complete, else
from the newest *complete* one (checkpoint_scan.py); trainer.resume=none refuses a folder that already holds a run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path

from rlmega.rundir.checkpoint_scan import STEP_DIR as _STEP_DIR
from rlmega.rundir.checkpoint_scan import (
    auto_choice,
    latest_name,
    newest_complete,
    problem,
    read_common,
    step_folders,
)
from rlmega.rundir.durable import fsync_dir, replace_durably

log = logging.getLogger("rlmega")


class ResumeError(RuntimeError):
    """trainer.resume cannot be done as asked; the message says what was found and the fix."""


def _clean(metrics: dict) -> dict:
    """JSON-safe: floats that are not finite become null (JSON has no NaN)."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in metrics.items()
    }


def earlier_run(path: str | Path) -> str | None:
    """What shows an earlier run in the run folder ``path`` (metrics lines, checkpoints), or None."""
    path = Path(path)
    held = []
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        lines = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())
        if lines:
            held.append(f"{lines} lines in metrics.jsonl")
    steps = step_folders(path / "checkpoints")
    if steps:
        held.append("checkpoints " + ", ".join(p.name for p in reversed(steps)))
    return ", ".join(held) or None


def refuse_a_held_folder(path: str | Path) -> None:
    """trainer.resume=none: ResumeError when ``path`` already holds a run. Called by the driver before
    RunDir opens the folder, so a refused start (a second trainer by mistake) changes nothing in it."""
    held = earlier_run(path)
    if held:
        raise ResumeError(
            f"trainer.resume=none, but trainer.run_dir={Path(path).absolute()} already holds a run ({held}); a "
            "fresh start there would mix the two runs' metrics and overwrite its checkpoints. Fix: continue it "
            "with --resume (trainer.resume=auto), or start over in a new trainer.run_dir (or delete "
            f"{Path(path).absolute()})"
        )


WARM_START = "warm_start.jsonl"


class RunDir:
    def __init__(
        self,
        path: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        # workers on other nodes resolve relative paths from another cwd
        self.path = Path(path).absolute()
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.metrics_path = self.path / "metrics.jsonl"
        self.stopped: str | None = None  # why the run ended before trainer.total_steps, if it did
        self._repair_metrics()
        self._tb = self._tensorboard() if tensorboard else None
        self._wandb = _start_wandb(self.path, wandb_project, config) if wandb_project else None

    def _tensorboard(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.path / "tensorboard"), purge_step=purge_step)

    def write_config(self, text: str) -> None:
        replace_durably(self.path / "config.yaml", text)

    def _repair_metrics(self) -> None:
        """Cut a half-written last line (disk full, power loss) back to the last newline: appending
        to it would glue the next step onto it, and the file would no longer parse."""
        try:
            with open(self.metrics_path, "rb+") as f:
                data = f.read()
                if not data or data.endswith(b"\n"):
                    return
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
        except FileNotFoundError:
            return
        log.warning(
            "%s ended in a half-written line (%d bytes after the last newline, from a write cut "
            "short): removed it; %d complete lines kept",
            self.metrics_path,
            len(data) - keep,
            data[:keep].count(b"\n"),
        )

    def log(self, metrics: dict) -> None:
        """Append one step's metrics (must contain "step")."""
        created = not self.metrics_path.exists()
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(_clean(metrics), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if created:  # the new file's name, too
            fsync_dir(self.path)
        if self._tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, metrics["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(
                {k: v for k, v in _clean(metrics).items() if k != "step"}, step=metrics["step"]
            )

    def write_warm_start(self, losses: list[float]) -> None:
        """RUN_DIR/warm_start.jsonl: the supervised warm start's loss, one line a step ({"sft_step", "loss"};
        written whole, then renamed). rlmega/rundir/plots.py draws it; the first RL step's row holds its first and
        last."""
        replace_durably(
            self.path / WARM_START,
            "".join(
                json.dumps(_clean({"sft_step": i, "loss": loss})) + "\n"
                for i, loss in enumerate(losses, 1)
            ),
        )

    def rewrite_metrics(self, history: list[dict]) -> None:
        """On resume: the metrics of the steps up to the checkpoint, and nothing after them.

        metrics.jsonl is rewritten (write, then rename); TensorBoard's event files are append-only,
        so a purge marker at the first step after the history hides the killed run's later
        points (SummaryWriter's purge_step), as TensorBoard documents for restarts.
        """
        replace_durably(
            self.metrics_path,
            "".join(json.dumps(_clean(m), sort_keys=True) + "\n" for m in history),
        )
        if self._tb is not None:
            self._tb.close()
            self._tb = self._tensorboard(
                purge_step=1 + max((m["step"] for m in history), default=0)
            )

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        rows = []
        for i, line in enumerate(self.metrics_path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(
                        f"{self.metrics_path} line {i} is not JSON ({e}): {line[:80]!r}"
                    ) from None
        return rows

    def latest_checkpoint(self) -> Path | None:
        pointer = self.checkpoints / "latest"
        if not pointer.exists():
            return None
        path = self.checkpoints / pointer.read_text().strip()
        return path if path.is_dir() else None

    def checkpoint_to_resume(self, resume: str) -> Path | None:
        """trainer.resume -> the complete checkpoint to start from, checked before any worker loads it.

        "none": None, but refused (ResumeError) when this folder already holds a run, whose metrics a
        fresh start would mix with its own. "auto": the one ``latest`` names when it is complete, else
        the newest complete checkpoint here (with a warning); None when nothing was ever saved; ResumeError
        when checkpoints exist but none is complete. A path: ``find_checkpoint``, which wins over
        this run's own checkpoints.
        """
        if resume == "none":
            refuse_a_held_folder(self.path)
            return None
        if resume != "auto":
            try:
                return find_checkpoint(resume)
            except FileNotFoundError as e:
                raise ResumeError(f"trainer.resume={resume}: {e}") from None
        named = latest_name(self.checkpoints)
        chosen = auto_choice(self.checkpoints)
        if chosen is not None and chosen.name == named:  # `latest` wins when complete
            return chosen
        found, skipped = newest_complete(self.checkpoints)
        if found is None:
            if skipped:
                raise ResumeError(
                    f"trainer.resume=auto: no complete checkpoint in {self.checkpoints} ({'; '.join(skipped)}). "
                    "Fix: restore a complete one, or start over in a new trainer.run_dir"
                )
            if named:
                raise ResumeError(
                    f"trainer.resume=auto: {self.checkpoints}/latest names {named}, but no checkpoint folder is "
                    "left there: nothing to resume from. Fix: restore the checkpoints, or start over in a new "
                    "trainer.run_dir"
                )
            return None  # nothing was ever saved here: a fresh start
        if skipped or named != found.name:
            pointer = (
                "is missing" if named is None else "is empty" if not named else f"names {named}"
            )
            log.warning(
                "resuming from %s, the newest complete checkpoint (checkpoints/latest %s%s). "
                "To resume from another one: trainer.resume=%s/step_N",
                found,
                pointer,
                "; skipped " + "; ".join(skipped) if skipped else "",
                self.checkpoints,
            )
        return found

    def earlier_run(self) -> str | None:
        """What shows an earlier run in this folder (metrics lines, checkpoints), or None."""
        return earlier_run(self.path)

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` complete checkpoints (never the latest one)."""
        latest = self.latest_checkpoint()
        steps = (
            sorted(p for p in self.checkpoints.iterdir() if _STEP_DIR.match(p.name))
            if self.checkpoints.exists()
            else []
        )
        doomed = [p for p in steps[:-keep] if p != latest] if keep > 0 else []
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
            # a gae run's critic of the same step
            shutil.rmtree(critic_checkpoint(p), ignore_errors=True)
        return doomed

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def critic_checkpoint(step_dir: str | Path) -> Path:
    """Where a gae run keeps the critic of checkpoint ``step_dir`` (checkpoints/step_N): beside it, in
    checkpoints/critic/step_N. The critic is saved first, so the policy's ``latest`` commits both."""
    step_dir = Path(step_dir)
    return step_dir.parent / "critic" / step_dir.name


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder from a step folder, or from a checkpoints root (its newest
    complete step folder; a warning when that is not the one its ``latest`` names).

    Raises FileNotFoundError saying what is wrong. Driver side, before any worker loads it (config
    validation uses it too): complete is checkpoint_scan.problem's test (every shard its index lists,
    at full length, and a loadable common.pt).
    """
    path = Path(path)
    if latest_name(path) is not None or step_folders(path):  # a checkpoints root
        found, skipped = newest_complete(path)
        if found is None:
            raise FileNotFoundError(
                f"no complete checkpoint in {path}"
                + (f" ({'; '.join(skipped)})" if skipped else "")
            )
        if skipped or latest_name(path) != found.name:
            log.warning(
                "%s: using %s, the newest complete checkpoint%s",
                path,
                found.name,
                " (skipped " + "; ".join(skipped) + ")" if skipped else "",
            )
        return found
    why = problem(path)
    if why == "not a folder":
        raise FileNotFoundError(f"{path} is not a folder")
    if why is not None:
        beside, _ = newest_complete(path.parent)
        raise FileNotFoundError(
            f"{path} cannot be resumed from: {why}. Give a complete checkpoints/step_N folder"
            + (f" (e.g. {beside})" if beside else "")
            + " or a checkpoints folder, whose newest complete step is used"
        )
    return path


def _start_wandb(path: Path, project: str, config: dict | None):
    """A wandb run that a resumed run continues (its id is kept in the run folder).

    WANDB_MODE=offline (no network) writes it under RUN_DIR/wandb for a later `wandb sync`.
    """
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            f"logging.wandb_project={project!r} needs wandb: pip install wandb "
            "(or unset logging.wandb_project)"
        ) from None
    id_file = path / "wandb_run_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return wandb.init(
        project=project,
        dir=str(path),
        id=id_file.read_text().strip(),
        resume="allow",
        config=config,
        name=path.name,
    )


def resume_settings(optimizer, total_steps: int, teachers: list[dict] | None = None) -> dict:
    """The settings a resume takes from the config rather than the checkpoint (``optimizer``: the optimizer
    section, a dataclass; rundir sits beside config, not above it, so it names no config type; and
    trainer.total_steps), by config field (saved with every checkpoint, so a resume can say which changed);
    ``teachers``: the distillation teachers' identities (rlmega.config.model_files.model_identity with each
    one's weight and tasks), which a resume may not change."""
    return {
        **{f"optimizer.{k}": v for k, v in dataclasses.asdict(optimizer).items()},
        "trainer.total_steps": total_steps,
        "distillation.teachers": teachers or [],
    }


def changed_settings(checkpoint: str | Path, now: dict) -> list[str]:
    """ "field: saved -> now" for each of ``now`` that differs from what the checkpoint recorded
    (nothing for a checkpoint from before the record was kept). Raises ResumeError for a change a
    resume cannot honour."""
    saved = read_common(checkpoint)["meta"]["extra"].get("settings") or {}
    changed = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
    fixed = sorted(_FIXED_ON_RESUME.keys() & changed.keys())
    if fixed:
        raise ResumeError(
            f"{checkpoint} was saved with "
            + "; ".join(f"{k}={changed[k][0]} ({_FIXED_ON_RESUME[k]})" for k in fixed)
            + f", which a resume cannot change; this run has {'; '.join(f'{k}={changed[k][1]}' for k in fixed)}. "
            f"Fix: set {', '.join(fixed)} as saved, or start a new run (trainer.run_dir) from its policy"
        )
    return [f"{k}: {was} -> {v}" for k, (was, v) in changed.items()]


# What a resume may not change, and why.
_FIXED_ON_RESUME = {
    # the optimizer state's layout on disk follows it (measured: both directions fail to load)
    "optimizer.use_distributed_optimizer": "the optimizer state on disk is laid out by it",
    # a resumed run continues one objective: the same teachers, weights and tasks, the same weights in them
    "distillation.teachers": "the run distils from them",
}
