"""Sharded FSDP2 checkpoints with torch.distributed.checkpoint (DCP), in the shared root layout.

    ROOT/step_00000010/   .metadata, __R_0.distcp (every rank's shards), common.pt (rank 0)
    ROOT/latest           written after the rename (rlmega/rundir/checkpoint_files.py: .partial, fsync, rename)

In the DCP files: "model" (this model's sharded state dict, HF names), "optimizer" (AdamW state and
param groups by parameter name), each extra model by its name, and "rng_rank{R}" per rank (Python,
NumPy, torch CPU and CUDA generators, as a torch.save stream). Loads read all of it as data, never as code
(rlmega/rundir/checkpoint_data.py): a checkpoint may come from elsewhere. common.pt holds {"meta":
{"backend": "fsdp", "step", "scheduler", "extra", "world_size", "extra_models", "lora"}}: what the driver reads
without loading tensors (rlmega/rundir/run.py reads meta.extra, rlmega/rundir/checkpoint_scan.py judges
completeness by "backend").

LoRA (rlmega/learner/lora.py): meta["lora"] is the adapters' (rank, alpha, target_modules), None for a full-parameter
model. A LoRA model loads a LoRA checkpoint of the same adapters, or a full-parameter one: its weights become
the frozen base and the adapters start at zero (the model computes what was saved), with fresh Adam state
for them (``load``). A full-parameter model refuses a LoRA checkpoint.

DCP reshards on load, so model and optimizer state load at any world size; the RNG state only at
the saved one (another world size has other ranks: each keeps its own seeded generators).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlmega.config.lora_rules import checkpoint_mismatch
from rlmega.rundir.checkpoint_data import data_only_loads, load_object
from rlmega.rundir.checkpoint_files import resolve, rng_state, saving, set_rng_state, start_save

log = logging.getLogger("rlmega")

# common.pt's meta["backend"]; rlmega/rundir/checkpoint_scan.py tells the two formats apart by it
BACKEND = "fsdp"


def _state(model, optimizer, extra_models: dict | None) -> dict:
    """The sharded state dicts DCP saves or loads into (views of the live DTensors)."""
    if optimizer is not None:
        # Before the first step torch makes zero Adam state here (a step with lr 0: the weights do
        # not move), so a save before any step loads like any other. That state is NOT fresh state:
        # its step count is 1, so the next real AdamW update is ~0.74x a fresh one's (bias
        # correction). Only a save before any optimizer step (e.g. every step so far skipped as
        # non-finite) hits this; a load overwrites it with the saved state.
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optimizer": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    for name, other in (extra_models or {}).items():
        if name in ("model", "optimizer") or name.startswith("rng_rank"):
            raise ValueError(
                f"extra_models: {name!r} is a reserved checkpoint key; name the model otherwise"
            )
        state[name] = get_model_state_dict(other)
    return state


def save(
    root: str | Path,
    step: int,
    model,
    optimizer=None,
    scheduler=None,
    extra: dict | None = None,
    extra_models: dict | None = None,
    lora: dict | None = None,
) -> Path:
    """Save everything for ``step`` under ``root``; returns the step folder. Collective.

    ``extra``: plain values stored once (rank 0's); ``extra_models``: other FSDP2 models saved
    alongside by name (the reference policy as {"reference": ref_model}). ``lora``: the model's adapters
    (rank, alpha, target_modules), None without.
    """
    root = Path(root)
    final, partial = start_save(root, step)
    rank = dist.get_rank()
    state = _state(model, optimizer, extra_models)
    # A key per rank (DCP keeps every rank's own copy), one torch.save stream: DCP would flatten a dict into
    # keys; the stream loads with torch's weights-only loader (load_object), a plain pickle would not.
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    state[f"rng_rank{rank}"] = buffer.getvalue()
    common = {
        "meta": {
            "backend": BACKEND,
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler else None,
            "extra": extra or {},
            "world_size": dist.get_world_size(),
            "has_optimizer_state": optimizer is not None,
            "extra_models": sorted(extra_models or {}),
            "lora": lora,
        }
    }
    with saving(root, partial, final):
        # collective: a failure on any rank raises on every rank
        dcp.save(state, checkpoint_id=str(partial))
        failure = None
        if rank == 0:
            try:
                torch.save(common, partial / "common.pt")
            except Exception as e:
                failure = e
        # rank 0's failure must stop every rank before the rename (else the others wait in its barrier)
        if _any_rank(failure is not None):
            if failure is not None:
                raise failure
            raise RuntimeError(f"rank 0 failed to write {partial / 'common.pt'}")
    return final


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (collective; nccl needs the tensor on the GPU)."""
    t = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return bool(t.item())


def read_meta(path: str | Path) -> dict:
    meta = torch.load(Path(path) / "common.pt", map_location="cpu", weights_only=True)["meta"]
    if meta.get("backend") != BACKEND:
        raise ValueError(
            f"{path} is not an FSDP checkpoint (actor.backend=fsdp); it was written by the "
            f"{meta.get('backend', 'megatron')} backend. Fix: resume it with that actor.backend"
        )
    return meta


def load(
    path: str | Path,
    model,
    optimizer=None,
    scheduler=None,
    extra_models: dict | None = None,
    lora: dict | None = None,
) -> tuple[int, dict]:
    """Load a checkpoint (a step folder, or a root whose ``latest`` is used). Returns (step, extra).

    Model (and optimizer, when given) at any world size; the RNG state when the world size is the
    saved one; the scheduler's step count when given. ``extra_models`` must have been saved. ``lora``: the
    model's adapters (as ``save`` takes them): a full-parameter checkpoint loads into the base (module
    docstring).
    """
    path = resolve(path)
    meta = read_meta(path)
    saved = meta.get("lora")
    why = checkpoint_mismatch(saved, lora, path)
    if why:
        raise ValueError(why)
    if lora is not None and saved is None:
        return _load_into_base(path, meta, model, scheduler, extra_models)
    missing = sorted(set(extra_models or {}) - set(meta["extra_models"]))
    if missing:
        raise ValueError(
            f"checkpoint {path} holds no {', '.join(missing)} model "
            f"(it has: {meta['extra_models'] or 'none'})"
        )
    if optimizer is not None and not meta["has_optimizer_state"]:
        raise ValueError(
            f"checkpoint {path} holds no optimizer state; load it with model_only=True"
        )
    state = _state(model, optimizer, extra_models)
    rng_key = f"rng_rank{dist.get_rank()}"
    same_world = meta["world_size"] == dist.get_world_size()
    if optimizer is not None and same_world:
        state[rng_key] = b""  # DCP fills it in (a saved object, not a tensor)
    with data_only_loads():
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    else:
        set_model_state_dict(model, state["model"])
    for name, other in (extra_models or {}).items():
        set_model_state_dict(other, state[name])
    if optimizer is not None:
        if scheduler is not None and meta["scheduler"] is not None:
            scheduler.load_state_dict(meta["scheduler"])
        if same_world:
            _restore_rng(state[rng_key], path)
    return int(meta["step"]), meta["extra"]


def _restore_rng(saved: bytes, path: Path) -> None:
    """This rank's generators from its saved stream. Checkpoints written before 2026-12-06 hold a plain pickle
    there, which is never unpickled: their generators stay as seeded, and the resume is not bit-exact."""
    try:
        state = load_object(io.BytesIO(saved))
    except Exception as e:  # noqa: BLE001 -- the old format, or a stream that holds more than data
        log.warning(
            "checkpoint %s: rank %d's RNG state was not restored (%s: %s); the run continues from freshly "
            "seeded generators, so it does not repeat the uninterrupted run exactly",
            path,
            dist.get_rank(),
            type(e).__name__,
            str(e).splitlines()[0][:160],
        )
        return
    set_rng_state(state)


def _load_into_base(
    path: Path, meta: dict, model, scheduler, extra_models: dict | None
) -> tuple[int, dict]:
    """A full-parameter checkpoint into a LoRA model: its policy's weights (HF names) into the frozen base
    layers; adapters, Adam state and RNG stay as built (B = 0: the model computes the saved policy), the
    schedule's step count is restored. A saved reference is not loaded: a LoRA run's reference is its base."""
    from rlmega.learner import lora

    if extra_models:
        raise ValueError(
            f"checkpoint {path}: a full-parameter checkpoint loads into a LoRA model's base only; "
            "the reference is that base"
        )
    live = get_model_state_dict(model)
    state = {"model": {lora.hf_name(k): v for k, v in live.items() if not lora.is_adapter(k)}}
    with data_only_loads():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(
        model,
        {
            **{k: v for k, v in live.items() if lora.is_adapter(k)},
            **{k: state["model"][lora.hf_name(k)] for k in live if not lora.is_adapter(k)},
        },
    )
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"]), meta["extra"]


def full_model_state_dict(model, cpu_offload: bool = True) -> dict:
    """The whole model by HF name on rank 0 (the others get {}). Collective."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    )
