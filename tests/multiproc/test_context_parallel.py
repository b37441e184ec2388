"""Context parallelism (parallelism.context_parallel_size) on the Megatron learner equals one process.

Each layout runs the same two RL steps (compute_logprobs, reference log-probs, train_step) on one tiny
Qwen2 (4 layers, 2 heads) and one batch of 12 samples of 13-58 tokens, packed several to a row, so every
row holds sequences cut into 2 x CP chunks of uneven lengths; the old log-probs, the metrics (loss,
gradient norm, pg loss, entropy, KL) of both steps and so the updates must equal world 1's.
"""

import dataclasses

import pytest

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

N, STEPS = 12, 2
KEYS = ("loss", "grad_norm", "pg_loss", "entropy", "kl_ref")
# Relative to the metric, or to 1e-2 where it is smaller: the pg loss at ratio 1 is minus the mean advantage of
# GRPO groups, ~1e-8 of cancellation whose sign follows the summation order (DP2 vs world 1: -1.1e-8 vs 3.7e-9)
FLOOR = 1e-2


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=4,
            seed=5,
        )
    )


def _batch():
    return random_batch(N, seed=3, prompt_len=(3, 20), response_len=(10, 40))


def _body(
    path, tp, pp, cp, world, max_tokens, algorithm, steps=STEPS, save=None, load=None, vpp=None
):
    """``steps`` RL steps; ``save``: a checkpoint after step 2 there; ``load``: start from that checkpoint
    (weights, optimizer, schedule: at another CP size too)."""
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
        ParallelismConfig(tp, pp, vpp, world, context_parallel_size=cp),
        OptimizerConfig(lr=3e-3, clip_grad=1.0),
        ActorConfig(max_tokens_per_micro_batch=max_tokens),
        AlgorithmConfig(
            **{"kl_coef": 0.05, "entropy_coef": 0.01, "kl_estimator": "k3", **algorithm}
        ),
        temperature=0.8,
    )
    actor.setup()
    if load:
        assert actor.load_checkpoint(load)[0] == 2
    batch = _batch()
    metrics, olds = [], []
    for step in range(1, steps + 1):
        old = actor.compute_logprobs(batch)
        ref = actor.compute_ref_logprobs(batch)
        metrics.append(
            actor.train_step(dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref))
        )
        olds.append(old)
        if save and step == 2:
            actor.save_checkpoint(save, step=2)
    shapes = [tuple(mb["tokens"].shape) for mb in actor._plan(batch)[0]]
    actor.teardown()
    return metrics, olds, shapes


# GSPO: sequence-level ratios and aggregation
ALGORITHMS = {"ppo": {}, "gspo": {"policy_loss": "gspo"}}


@pytest.fixture(scope="module")
def reference(hf_model, tmp_path_factory):
    """World 1's runs: PPO for 4 steps (its step-2 checkpoint in "ckpt"), GSPO for 2."""
    ckpt = tmp_path_factory.mktemp("cp1") / "ckpt"
    out = {
        "ppo": run_on_ranks(
            _body, 1, args=(hf_model, 1, 1, 1, 1, 160, {}, 4, str(ckpt)), timeout_s=300
        )[0],
        "gspo": run_on_ranks(
            _body, 1, args=(hf_model, 1, 1, 1, 1, 160, ALGORITHMS["gspo"]), timeout_s=300
        )[0],
    }
    out["ckpt"] = ckpt
    return out


LAYOUTS = {  # name: (tp, pp, vpp, cp, world, per-rank token budget, algorithm)
    "cp2": (1, 1, None, 2, 2, 80, "ppo"),
    "cp2_gspo": (1, 1, None, 2, 2, 80, "gspo"),
    "cp2_tp2": (
        2,
        1,
        None,
        2,
        4,
        80,
        "ppo",
    ),  # sequence parallel (on at TP > 1): each CP share split over TP
    "cp2_dp2": (1, 1, None, 2, 4, 80, "ppo"),
    "cp2_pp2_vpp2": (
        1,
        2,
        2,
        2,
        4,
        40,
        "ppo",
    ),  # pipeline stages, interleaved: 2 micro-batches a rank at least
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_one_process(hf_model, reference, name):
    tp, pp, vpp, cp, world, budget, alg = LAYOUTS[name]
    results = run_on_ranks(
        _body,
        world,
        args=(hf_model, tp, pp, cp, world, budget, ALGORITHMS[alg]),
        kwargs={"vpp": vpp},
        timeout_s=300,
    )
    ref_metrics, ref_olds, ref_shapes = reference[alg]
    ref_metrics, ref_olds = ref_metrics[:STEPS], ref_olds[:STEPS]
    for rank, (metrics, olds, shapes) in enumerate(results):
        # each rank holds its half of every row (+ at most a chunk's rounding per sequence, and the TP multiple
        # under sequence parallelism); at DP 1 with CP x the budget, the reference's very micro-batches
        assert all(s[1] <= budget + 8 + tp for s in shapes), shapes
        if world == tp * pp * cp and budget * cp == 160 and vpp is None:
            assert len(shapes) == len(ref_shapes) and all(
                r[1] / cp <= s[1] <= r[1] / cp + 8 + tp for s, r in zip(shapes, ref_shapes)
            ), (shapes, ref_shapes)
        rel = max(
            abs(g[k] - r[k]) / max(abs(r[k]), FLOOR)
            for g, r in zip(metrics, ref_metrics)
            for k in KEYS
        )
        lp = max(
            (a - b).abs().max().item()
            for got, want in zip(olds, ref_olds)
            for a, b in zip(got, want)
        )
        print(f"{name} rank {rank}: metrics relative {rel:.2e}, old log-probs {lp:.2e}")
        assert rel <= 1e-5, (name, rank, metrics, ref_metrics)
        assert lp <= 1e-5, (name, rank, lp)
        assert all(g["tokens"] == r["tokens"] for g, r in zip(metrics, ref_metrics))


def test_checkpoints_resume_at_another_context_parallel_size(hf_model, reference, tmp_path):
    """CP2's step-2 checkpoint resumed at CP1, and CP1's at CP2: steps 3 and 4 equal world 1's straight run.
    Step 4 shows the optimizer state came along (the distributed optimizer's shards reshard over DP x CP):
    a fresh Adam state at step 3 moves step 4's KL to the reference from 0.58 to 0.33 (measured)."""
    ref_metrics = reference["ppo"][0]
    run_on_ranks(
        _body, 2, args=(hf_model, 1, 1, 2, 2, 80, {}, 2, str(tmp_path / "cp2")), timeout_s=300
    )
    at_cp1 = run_on_ranks(
        _body,
        1,
        args=(hf_model, 1, 1, 1, 1, 160, {}, 2, None, str(tmp_path / "cp2")),
        timeout_s=300,
    )[0][0]
    at_cp2 = run_on_ranks(
        _body,
        2,
        args=(hf_model, 1, 1, 2, 2, 80, {}, 2, None, str(reference["ckpt"])),
        timeout_s=300,
    )[0][0]
    for what, got in (("cp2 -> cp1", at_cp1), ("cp1 -> cp2", at_cp2)):
        rel = max(
            abs(g[k] - r[k]) / max(abs(r[k]), FLOOR)
            for g, r in zip(got, ref_metrics[2:])
            for k in KEYS
        )
        print(f"{what}: steps 3-4 relative {rel:.2e}")
        assert rel <= 1e-5, (what, got, ref_metrics[2:])
