"""The reference policy: where it starts, how it moves, and that checkpoints carry it (issue 9).

TP2 on 2 gloo ranks, a tiny Qwen2 and one synthetic RolloutBatch. KL in the loss pulls toward the
reference, so it must be the policy RL starts from (after a warm start, not model.path), the
Polyak update must move it, and a resumed run must get back the reference it had, not model.path's.
"""

import dataclasses

import pytest

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=2,
            seed=3,
        )
    )


def _actor(path, rate):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=path),
        ParallelismConfig(2, 1, None, 2),
        OptimizerConfig(lr=1e-2),
        ActorConfig(max_tokens_per_micro_batch=64, ref_update_rate=rate),
        AlgorithmConfig(kl_coef=0.05, kl_estimator="k3"),
    )
    actor.setup()
    return actor


def _diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _train_and_save_body(path, ckpt):
    batch = random_batch(8, seed=2)
    actor = _actor(path, rate=0.25)
    hf_ref = actor.compute_ref_logprobs(batch)
    actor.sft_step(batch)  # a warm start moves the policy away from model.path
    moved = _diff(actor.compute_logprobs(batch), hf_ref)
    actor.update_ref_policy(1.0)  # what the driver does after the warm start
    after_copy = _diff(actor.compute_ref_logprobs(batch), actor.compute_logprobs(batch))
    old = actor.compute_logprobs(batch)
    actor.train_step(
        dataclasses.replace(batch, old_logprobs=old, ref_logprobs=actor.compute_ref_logprobs(batch))
    )
    before_polyak = actor.compute_ref_logprobs(batch)
    actor.update_ref_policy()  # actor.ref_update_rate = 0.25
    polyak_moved = _diff(actor.compute_ref_logprobs(batch), before_polyak)
    saved_ref = actor.compute_ref_logprobs(batch)
    actor.save_checkpoint(ckpt, 1, {"note": "x"})
    actor.teardown()
    return dict(moved=moved, after_copy=after_copy, polyak_moved=polyak_moved, saved_ref=saved_ref)


def _resume_body(path, ckpt, saved_ref):
    # A resumed run, in fresh processes as a real one: the reference is rebuilt from model.path first.
    batch = random_batch(8, seed=2)
    fresh = _actor(path, rate=0.25)
    fresh_before_load = _diff(fresh.compute_ref_logprobs(batch), saved_ref)
    step, extra = fresh.load_checkpoint(ckpt)
    restored = _diff(fresh.compute_ref_logprobs(batch), saved_ref)
    still_offloaded = "params" in fresh.reference.offloaded
    fresh.teardown()
    return dict(
        fresh_before_load=fresh_before_load,
        restored=restored,
        step=step,
        extra=extra,
        still_offloaded=still_offloaded,
    )


def test_reference_follows_warm_start_polyak_and_checkpoints(hf_model, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    r = run_on_ranks(_train_and_save_body, 2, args=(hf_model, ckpt), timeout_s=400)[0]
    assert r["moved"] > 1e-3  # the warm start changed the policy
    assert r["after_copy"] == 0.0  # reference == policy, bit for bit, after the copy
    # the Polyak update moved the reference toward the trained policy
    assert r["polyak_moved"] > 1e-6
    q = run_on_ranks(_resume_body, 2, args=(hf_model, ckpt, r["saved_ref"]), timeout_s=400)[0]
    assert q["fresh_before_load"] > 1e-3  # model.path's reference is not the one that was saved ...
    assert q["restored"] == 0.0  # ... and the checkpoint brings the saved one back exactly
    assert q["step"] == 1 and q["extra"] == {"note": "x"}
    assert q["still_offloaded"]  # loading kept the reference's offload state


def _no_move_body(path, ckpt):
    from rlmega.megatron import checkpoint

    actor = _actor(path, rate=0.0)
    actor.save_checkpoint(ckpt, 1)
    saved = checkpoint.saved_models(checkpoint.latest(ckpt))
    actor.teardown()
    return saved


def test_an_untouched_reference_is_not_saved(hf_model, tmp_path):
    # It equals model.path's weights: a resume rebuilds it from there, and the checkpoint stays small.
    assert (
        run_on_ranks(_no_move_body, 2, args=(hf_model, str(tmp_path / "c")), timeout_s=300)[0] == []
    )


def _heap_body():
    import gc
    import time

    t = time.perf_counter()
    gc.collect()
    return gc.get_freeze_count(), time.perf_counter() - t


def test_ranks_inherit_the_forkservers_imports_frozen():
    """rlmega/testing/rank_preload.py: a rank's full collection skips the ~750k objects it was forked with
    (0.08-0.10 s here, 0.35-0.38 s with them unfrozen)."""
    for frozen, _ in run_on_ranks(_heap_body, world_size=2, timeout_s=120):
        assert frozen > 100_000, frozen  # torch, transformers, megatron-core
