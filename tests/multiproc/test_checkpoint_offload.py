"""Checkpoints restore everything bit for bit; offload/onload is invisible to training.

All on real gloo ranks with MegatronModelManager on a tiny Qwen2 model.
"""

import random

import numpy as np
import pytest
import torch

from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

ROWS, SEQ, MBS = 4, 12, 1


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=4,
            seed=3,
        )
    )


def _manager(
    path: str,
    tp: int,
    pp: int,
    load_weights: bool = True,
    lr_warmup_steps: int = 3,
    lr_decay_steps: int = 20,
    **optimizer,
):
    import torch.distributed as dist

    from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.model_manager import MegatronModelManager

    optimizer = {"lr": 1e-2, "weight_decay": 0.01, "lr_decay_style": "cosine", **optimizer}
    mm = MegatronModelManager(
        ModelConfig(path=path),
        ParallelismConfig(tp, pp, None, dist.get_world_size()),
        OptimizerConfig(lr_warmup_steps=lr_warmup_steps, **optimizer),
        lr_decay_steps=lr_decay_steps,
    )
    mm.setup_model_and_optimizer(load_weights=load_weights)
    return mm


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 59, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _step(mm, seed: int) -> tuple[float, float, float]:
    from rlmega.megatron.lm_step import lm_forward_backward
    from rlmega.megatron.runtime import data_parallel_rank_and_size

    dp_rank, dp = data_parallel_rank_and_size()
    loss = lm_forward_backward(mm.model, _tokens(seed).chunk(dp)[dp_rank], MBS)
    ok, grad_norm, lr = mm.optimizer_step()
    assert ok
    return loss, grad_norm, lr


def _snapshot(mm) -> dict:
    from rlmega.megatron import checkpoint, offload

    return {
        "params": [p.detach().clone() for p in offload.model_params(mm.model)],
        "moments": [t.clone() for t in offload.optimizer_state(mm.optimizer)],
        "scheduler": mm.scheduler.state_dict(),
        "rng": checkpoint.rng_state(),
        "draw": None,
    }


def _same(a, b) -> bool:
    """Bitwise equality of nested tensors / numpy arrays / plain values."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _save_step_load_body(path: str, ckpt: str) -> dict:
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(2, 2, None, seed=1)
    mm = _manager(path, 2, 2)
    _step(mm, seed=0)  # Adam moments and the schedule exist
    mm.save_checkpoint(ckpt, step=1, extra={"data_position": 17})
    saved = _snapshot(mm)
    first = _step(mm, seed=1)
    torch.rand(5), random.random(), np.random.rand()  # move every RNG on
    step, extra = mm.load_checkpoint(ckpt)
    restored = _snapshot(mm)
    again = _step(mm, seed=1)
    # random init: must differ from the saved weights
    fresh = _manager(path, 2, 2, load_weights=False)
    out = {
        "step": step,
        "extra": extra,
        "first": first,
        "again": again,
        "diff": {k: not _same(saved[k], restored[k]) for k in saved},
        "n_moments": len(saved["moments"]),
        "fresh_differs": not _same(saved["params"], _snapshot(fresh)["params"]),
    }
    teardown_megatron()
    return out


def test_save_step_load_restores_everything_bitwise(hf_model, tmp_path):
    results = run_on_ranks(
        _save_step_load_body, 4, args=(hf_model, str(tmp_path / "ckpt")), timeout_s=300
    )
    for rank, r in enumerate(results):
        assert r["step"] == 1 and r["extra"] == {"data_position": 17}
        assert r["n_moments"] > 0
        assert not any(r["diff"].values()), f"rank {rank}: differs after load: {r['diff']}"
        assert r["again"] == r["first"], f"rank {rank}: repeated step {r['again']} != {r['first']}"
        assert r["fresh_differs"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000001"


def _train_save_logits_body(path: str, ckpt: str, out: str):
    from rlmega.megatron.lm_step import forward_logits
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(2, 1, None, seed=1)
    mm = _manager(path, 2, 1)
    for s in range(2):
        _step(mm, seed=s)  # weights now differ from the HF folder
    mm.save_checkpoint(ckpt, step=2)
    logits = forward_logits(mm.model, _tokens(9)[:, :-1])
    mm.export_hf(out)
    teardown_megatron()
    return logits


def _load_logits_body(path: str, ckpt: str, out: str):
    from rlmega.megatron.lm_step import forward_logits
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 2, None, seed=7)
    mm = _manager(path, 1, 2, load_weights=False)
    with pytest.raises(ValueError, match="layout"):
        mm.load_checkpoint(ckpt)  # optimizer state does not reshard: a clear error
    step, _ = mm.load_checkpoint(ckpt, model_only=True)
    logits = forward_logits(mm.model, _tokens(9)[:, :-1])
    mm.export_hf(out)
    teardown_megatron()
    return step, logits


def test_save_tp2_load_pp2_gives_identical_model(hf_model, tmp_path):
    from safetensors.torch import load_file

    ckpt = str(tmp_path / "ckpt")
    saved = run_on_ranks(
        _train_save_logits_body, 2, args=(hf_model, ckpt, str(tmp_path / "a")), timeout_s=300
    )[0]
    step, loaded = run_on_ranks(
        _load_logits_body, 2, args=(hf_model, ckpt, str(tmp_path / "b")), timeout_s=300
    )[1]
    assert step == 2
    assert (loaded - saved).abs().max() <= 1e-5  # TP2 and PP2 round matmuls differently
    a = {k: v for f in (tmp_path / "a").glob("*.safetensors") for k, v in load_file(f).items()}
    b = {k: v for f in (tmp_path / "b").glob("*.safetensors") for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the weights: bitwise


def _schedule_on_resume_body(path: str, ckpt: str) -> dict:
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1, None, seed=1)
    mm = _manager(path, 1, 1)
    for s in range(4):
        _step(mm, seed=s)
    mm.save_checkpoint(ckpt, step=4)
    straight = [_step(mm, seed=s)[2] for s in (4, 5)]
    same = _manager(path, 1, 1, load_weights=False)
    same.load_checkpoint(ckpt)
    resumed_same = [_step(same, seed=s)[2] for s in (4, 5)]
    # Every schedule field changed: peak and final LR, warm-up, decay style and length (total_steps),
    # weight decay; and Adam's betas and eps, which live in the optimizer's param groups.
    new = {
        "lr": 5e-3,
        "min_lr": 1e-4,
        "lr_warmup_steps": 1,
        "lr_decay_style": "linear",
        "lr_decay_steps": 40,
        "weight_decay": 0.05,
        "adam_beta1": 0.8,
        "adam_beta2": 0.99,
        "adam_eps": 1e-6,
    }
    changed = _manager(path, 1, 1, load_weights=False, **new)
    changed.load_checkpoint(ckpt)
    groups = [(g["betas"], g["eps"]) for g in changed.optimizer.param_groups]
    resumed_changed = [_step(changed, seed=s)[2] for s in (4, 5)]
    wd = changed.optimizer.param_groups[0]["weight_decay"]
    ref = _manager(path, 1, 1, load_weights=False, **new)  # the new config's schedule, 4 steps in
    ref.scheduler.step(increment=4)
    want = [ref.optimizer.param_groups[0]["lr"]]
    ref.scheduler.step(increment=1)
    want.append(ref.optimizer.param_groups[0]["lr"])
    teardown_megatron()
    return {
        "straight": straight,
        "same": resumed_same,
        "changed": resumed_changed,
        "want": want,
        "groups": groups,
        "wd": wd,
        "steps": changed.scheduler.num_steps,
    }


def test_resume_keeps_the_schedule_and_honours_a_changed_one(hf_model, tmp_path):
    # Issue 22 item 5: the checkpoint's LR schedule silently won over a changed optimizer.* or
    # trainer.total_steps (the decay length). Unchanged: the schedule goes on as if never stopped;
    # changed: the new schedule, at the step count the checkpoint reached.
    r = run_on_ranks(
        _schedule_on_resume_body, 1, args=(hf_model, str(tmp_path / "ckpt")), timeout_s=300
    )[0]
    assert r["same"] == r["straight"]
    assert r["changed"] == r["want"] and r["want"] != r["straight"], r
    assert r["wd"] == 0.05 and r["steps"] == 6
    assert set(r["groups"]) == {((0.8, 0.99), 1e-6)}, r["groups"]


def _crash_during_save_body(path: str, ckpt: str):
    from rlmega.megatron import checkpoint
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 2, None, seed=1)
    mm = _manager(path, 1, 2)
    _step(mm, seed=0)
    mm.save_checkpoint(ckpt, step=1)
    _step(mm, seed=1)
    real_save = checkpoint.dist_checkpointing.save

    def save_then_die(sd, directory, *a, **kw):
        real_save(sd, directory, *a, **kw)  # all shards written ...
        raise RuntimeError("node lost")  # ... and the process dies before the rename

    checkpoint.dist_checkpointing.save = save_then_die
    try:
        mm.save_checkpoint(ckpt, step=2)
    except RuntimeError as e:
        crashed = str(e)
    checkpoint.dist_checkpointing.save = real_save
    step, _ = mm.load_checkpoint(ckpt)
    teardown_megatron()
    return crashed, step


def test_a_crash_during_save_never_looks_complete(hf_model, tmp_path):
    ckpt = tmp_path / "ckpt"
    results = run_on_ranks(_crash_during_save_body, 2, args=(hf_model, str(ckpt)), timeout_s=300)
    assert all(r == ("node lost", 1) for r in results), results
    assert (ckpt / "latest").read_text().strip() == "step_00000001"
    # a save that raised is undone (a process that dies instead leaves step_2.partial, which nothing
    # loads: tests/unit/test_config.py::test_resume_must_be_a_complete_checkpoint)
    assert not (ckpt / "step_00000002").exists() and not (ckpt / "step_00000002.partial").exists()


def _offload_body(path: str, offload_between: bool):
    from rlmega.megatron import offload
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(2, 2, None, seed=1)
    mm = _manager(path, 2, 2)
    _step(mm, seed=0)
    released, restored = None, None
    if offload_between:
        before = _snapshot(mm)
        grads = [g.clone() for g in offload.model_grads(mm.model)]
        storages = {
            "params": offload._distinct_storages(offload.model_params(mm.model)),
            "grads": offload._distinct_storages(offload.model_grads(mm.model)),
            "optimizer state": offload._distinct_storages(offload.optimizer_state(mm.optimizer)),
        }
        held = {k: sum(s.nbytes() for s in v) for k, v in storages.items()}
        assert all(held.values()), held  # there was something to release
        mm.offload_params()
        mm.offload_grads()
        mm.offload_optimizer_state()
        mm.offload_megatron_copy_params()  # fp32: the master weights are the params; nothing extra
        released = {k: sum(s.nbytes() for s in v) for k, v in storages.items()}
        mm.load_megatron_copy_params()
        mm.onload_optimizer_state()
        mm.onload_grads()
        mm.onload_params()
        after = _snapshot(mm)
        restored = all(_same(before[k], after[k]) for k in ("params", "moments")) and _same(
            grads, offload.model_grads(mm.model)
        )
    result = _step(mm, seed=1)
    params = [p.detach().clone() for p in offload.model_params(mm.model)]
    teardown_megatron()
    return released, restored, result, params


def test_offload_onload_is_bit_exact_and_invisible_to_training(hf_model):
    plain = run_on_ranks(_offload_body, 4, args=(hf_model, False), timeout_s=300)
    cycled = run_on_ranks(_offload_body, 4, args=(hf_model, True), timeout_s=300)
    for rank, ((_, _, res_a, params_a), (released, restored, res_b, params_b)) in enumerate(
        zip(plain, cycled)
    ):
        assert released == {"params": 0, "grads": 0, "optimizer state": 0}, (
            f"rank {rank}: {released}"
        )
        assert restored, f"rank {rank}: onload did not restore the bytes"
        assert res_a == res_b, f"rank {rank}: step after offload {res_b} != {res_a}"
        assert _same(params_a, params_b)
