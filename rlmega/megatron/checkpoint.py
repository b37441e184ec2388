"""Atomic Megatron distributed checkpoints: model, optimizer, LR schedule, RNG, caller's extras.

Layout under a checkpoint root:
    step_00000010/          a complete checkpoint (Megatron dist-checkpointing format)
    step_00000012.partial/  a save in progress, or one that crashed: never loaded
    latest                  the newest complete step, written by rename after the save finished

Every rank writes its shards into ``.partial``; after a barrier rank 0 fsyncs it, renames it and
then updates ``latest`` (fsynced), so a crash at any point leaves a complete checkpoint to load
(rlmega/rundir/checkpoint_files.py, shared with the FSDP backend).
Model weights reshard on load (save at TP2, load at PP2); optimizer state is restored when PP, TP and EP
are the same (DP and CP may differ: the distributed optimizer's shards reshard over DP x CP), RNG state
when the whole layout is. RNG state is per rank (Python, NumPy, torch, CUDA,
Megatron's tracker), stored as one sharded object per (PP, TP, DP[, CP]) coordinate.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

# The root's files (step_N, .partial, latest, disk-full handling) are backend-neutral
# (rlmega/rundir/checkpoint_files.py); the names are re-exported here for this backend's callers
# (megatron/engine.py's checkpoint.latest, the tests' checkpoint._move_into_place).
from rlmega.rundir.checkpoint_files import (  # noqa: F401
    CheckpointSpaceError,
    _move_into_place,
    _out_of_space,
    _replaced,
    finish_save,
    latest,
    resolve,
    saving,
    start_save,
    step_dir,
    undo_failed_save,
)
from rlmega.config.lora_rules import checkpoint_mismatch
from rlmega.rundir.checkpoint_data import data_only_loads
from rlmega.rundir import checkpoint_files as files
from rlmega.megatron.hf_io import unwrap
from rlmega.megatron.offload import torch_optimizers
from rlmega.megatron.save_results import use_in_process_queue


def _coords() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank in the (PP, TP, DP[, CP]) grid: one RNG state per rank. CP joins only when
    > 1, so checkpoints without it keep their 3-d objects."""
    shape = [
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    ]
    offset = [
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    ]
    if ps.get_context_parallel_world_size() > 1:
        shape.append(ps.get_context_parallel_world_size())
        offset.append(ps.get_context_parallel_rank())
    return tuple(shape), tuple(offset)


def _layout() -> tuple[int, ...]:
    """(PP, TP, DP, EP, CP): what optimizer and RNG state depend on (MoE experts' optimizer shards follow EP)."""
    pp, tp, dp = _coords()[0][:3]
    return (
        pp,
        tp,
        dp,
        ps.get_expert_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
    )


def _saved_layout(meta: dict) -> tuple[int, ...]:
    layout = tuple(meta["layout"])
    return layout + (1,) * (5 - len(layout))  # checkpoints from before EP or CP: EP 1, CP 1


def rng_state() -> dict:
    """checkpoint_files.rng_state and Megatron's tensor-parallel RNG tracker's states."""
    return {**files.rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    files.set_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])


# Each rank saves and loads its own optimizer buffers, in parallel, with no gather. This
# format reshards across data parallel (and CP: the optimizer shards over DP x CP); PP, TP and EP must match.
_OPTIM_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _has_state(optimizer) -> bool:
    """Adam state exists only after the first step; before it there is nothing to save."""
    return any(len(o.state) for o in torch_optimizers(optimizer))


def _sharded(
    model, optimizer, with_rng: bool, extra_models: dict | None = None, base_only: bool = False
) -> dict:
    """``base_only``: the model's tensors without its LoRA adapters (a full-parameter checkpoint's)."""
    sd = {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(model)}
    if base_only:
        # lora_adapters.SUFFIX
        sd = {k: {n: t for n, t in v.items() if "_lora." not in n} for k, v in sd.items()}
    for name, chunks in (extra_models or {}).items():
        # Sharded keys are global names in the checkpoint: a prefix keeps a second copy of the
        # same architecture (the reference policy) apart from the policy's tensors.
        sd.update(
            {
                f"{name}{i}": unwrap(c).sharded_state_dict(prefix=f"{name}.")
                for i, c in enumerate(chunks)
            }
        )
    if optimizer is not None and _has_state(optimizer):
        sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=_OPTIM_FORMAT)
    if with_rng:
        shape, offset = _coords()
        sd["rng"] = ShardedObject("rng_state", rng_state(), shape, offset, replica_id=0)
    return sd


def save(
    root: str | Path,
    step: int,
    model: list,
    optimizer=None,
    scheduler=None,
    extra: dict | None = None,
    extra_models: dict[str, list] | None = None,
    lora: dict | None = None,
) -> Path:
    """Save everything for ``step`` under ``root`` (collective: every rank calls it).

    ``extra_models``: other models of the same layout saved alongside, by name (e.g. the
    reference policy as {"reference": chunks}); ``load`` restores those it is given. ``lora``: the model's
    LoRA adapters (config/lora_rules.checkpoint_record), None without.
    """
    root = Path(root)
    final, partial = start_save(root, step)
    sd = _sharded(model, optimizer, with_rng=True, extra_models=extra_models)
    # Plain values are "common" state: rank 0 stores them once.
    sd["meta"] = {
        "step": step,
        "has_optimizer_state": "optimizer" in sd,
        "scheduler": scheduler.state_dict() if scheduler else None,
        "extra": extra or {},
        "layout": _layout(),
        "extra_models": sorted(extra_models or {}),
        "lora": lora,
    }
    # else Megatron's writer starts a Manager process that outlives a kill -9
    use_in_process_queue()
    with saving(root, partial, final):
        # collective: a failure on any rank raises on every rank
        dist_checkpointing.save(sd, str(partial))
        dist.barrier()  # every rank's shards are on disk
    return final


def _restore_adam_step(optimizer, saved: dict) -> None:
    """Put back Adam's step counter (it sets the bias correction).

    Without Apex/TE, Megatron keeps the step in the saved param groups, and its dp_reshardable
    loader then copies the *in-memory* per-parameter step over the restored one; so each
    parameter gets a fresh counter holding the saved value.
    """
    # a ChainedOptimizer of several (MoE: dense and expert parameters) saves one state per inner
    # optimizer, by index; its steps are kept equal (megatron's _synchronize_steps)
    states = [saved] if "optimizer" in saved else [v for v in saved.values() if isinstance(v, dict)]
    groups = [g for st in states for g in st.get("optimizer", {}).get("param_groups", [])]
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) != 1:
        return  # Apex/TE fused Adam: the step lives in the param groups themselves
    step = steps.pop()
    for o in torch_optimizers(optimizer):
        for st in o.state.values():
            if "step" in st:
                st["step"] = torch.full_like(st["step"], step)


def saved_models(path: str | Path) -> list[str]:
    """Names of the extra models (``save(extra_models=...)``) stored in a complete checkpoint."""
    return list(
        dist_checkpointing.load_common_state_dict(str(path))["meta"].get("extra_models", [])
    )


def load(
    path: str | Path,
    model: list,
    optimizer=None,
    scheduler=None,
    extra_models: dict[str, list] | None = None,
    lora: dict | None = None,
) -> tuple[int, dict]:
    """Load a checkpoint (a step dir, or a root whose ``latest`` is used). Returns (step, extra).

    Model weights load into any layout; optimizer and scheduler only when given and the saved PP, TP and EP
    equal the current ones; RNG when the whole layout does. ``extra_models`` (name -> chunks) must have been saved.
    ``lora``: the model's adapters (as ``save`` takes them): the checkpoint's must be the same, or none (a
    full-parameter checkpoint loads into the base, ``_load_into_base``).
    """
    path = resolve(path)
    common = dist_checkpointing.load_common_state_dict(str(path))
    meta = common["meta"]
    why = checkpoint_mismatch(meta.get("lora"), lora, path)
    if why:
        raise ValueError(why)
    if lora is not None and meta.get("lora") is None:
        return _load_into_base(path, meta, model, scheduler, extra_models)
    saved, now = _saved_layout(meta), _layout()
    same_layout = saved == now
    # the distributed optimizer shards its state over DP x CP ranks ("dp_reshardable": it reshards across
    # them); a TP, PP or EP change would need another format
    if optimizer is not None and _model_split(saved) != _model_split(now):
        raise ValueError(
            f"checkpoint layout (PP, TP, DP, EP, CP)={saved} differs from the current {now} in PP, TP "
            "or EP: load it with model_only=True, or restore the saved PP, TP and EP (DP and CP may "
            "change)"
        )
    missing = sorted(set(extra_models or {}) - set(meta.get("extra_models", [])))
    if missing:
        raise ValueError(
            f"checkpoint {path} holds no {', '.join(missing)} model "
            f"(it has: {meta.get('extra_models', []) or 'none'})"
        )
    sd = _sharded(
        model, None, with_rng=same_layout and optimizer is not None, extra_models=extra_models
    )
    with_optimizer_state = optimizer is not None and meta["has_optimizer_state"]
    if with_optimizer_state and not _has_state(optimizer):
        # A fresh optimizer (a resumed run) has no Adam state for Megatron to load into; it makes
        # placeholder state with a zero-gradient step. Every value it touches (moments, step,
        # and the model weights loaded just below) is then overwritten from the checkpoint.
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner._init_optimizer_states_with_dummy_values()
    if with_optimizer_state:
        sd["optimizer"] = optimizer.sharded_state_dict(
            {k: v for k, v in sd.items() if k.startswith("model")},
            is_loading=True,
            metadata=_OPTIM_FORMAT,
        )
    # the folder may come from elsewhere: data, never code (rundir/checkpoint_data.py)
    with data_only_loads():
        loaded = dist_checkpointing.load(sd, str(path))
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    for name, chunks in (extra_models or {}).items():
        for i, chunk in enumerate(chunks):
            # keys come back with the prefix they were saved under
            state = {k.removeprefix(f"{name}."): v for k, v in loaded[f"{name}{i}"].items()}
            unwrap(chunk).load_state_dict(state)
    if with_optimizer_state:
        # no_grad: with fp32 params the optimizer's main params are views of the (grad-requiring)
        # model params, and Megatron copies into them in place.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(optimizer, loaded["optimizer"])
    elif optimizer is not None:  # saved before the first step: start from fresh Adam state
        for o in torch_optimizers(optimizer):
            o.state.clear()
    if optimizer is not None:
        if scheduler is not None and meta["scheduler"] is not None:
            scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved count
            scheduler.load_state_dict(meta["scheduler"])
        # per-rank streams: another layout starts from the seeds (dropout is off in RL)
        if same_layout:
            set_rng_state(loaded["rng"])
    return int(meta["step"]), meta["extra"]


def _load_into_base(
    path: Path, meta: dict, model: list, scheduler, extra_models: dict | None
) -> tuple[int, dict]:
    """A full-parameter checkpoint into a LoRA model (any layout): its policy's weights into the frozen base;
    adapters, Adam state and RNG stay as built (B = 0: the model computes the saved policy), the schedule's
    step count is restored. A saved reference is not loaded: a LoRA run's reference is its base."""
    if extra_models:
        raise ValueError(
            f"checkpoint {path}: a full-parameter checkpoint loads into a LoRA model's base only; "
            "the reference is that base"
        )
    with data_only_loads():
        loaded = dist_checkpointing.load(
            _sharded(model, None, with_rng=False, base_only=True), str(path)
        )
    for i, chunk in enumerate(model):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        left = [k for k in missing if "_lora." not in k] + list(unexpected)
        if left:
            raise RuntimeError(
                f"checkpoint {path} into a LoRA model's base: tensors not matched: {left[:4]}"
            )
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved count
        scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"]), meta["extra"]


def _model_split(layout: tuple[int, ...]) -> tuple[int, int, int]:
    """(PP, TP, EP) of a (PP, TP, DP, EP, CP) layout: what the optimizer's saved shards depend on."""
    return layout[0], layout[1], layout[3]
