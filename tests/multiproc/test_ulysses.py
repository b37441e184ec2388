"""Ulysses sequence parallelism (actor.ulysses_size) on the FSDP learner equals one process.

The same two RL steps (compute_logprobs, reference log-probs, train_step) on one tiny Qwen2 (2 layers, 4 heads,
2 KV heads) and 12 samples of 13-58 tokens packed several to a row: at Ulysses 2 (one group) and Ulysses 2 x DP 2
the old log-probs, the metrics of both steps and the trained weights must equal world 1's.
"""

import dataclasses

import pytest

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

N, STEPS = 12, 2
KEYS = ("loss", "grad_norm", "pg_loss", "entropy", "kl_ref")
FLOOR = 1e-2  # as in test_context_parallel.py: the pg loss at ratio 1 is ~1e-8 of cancellation


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            num_layers=2,
            seed=7,
        )
    )


def _body(path, world, ulysses, max_tokens, recompute=False):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.fsdp.actor import FSDPActor

    actor = FSDPActor(
        ModelConfig(path=path),
        ParallelismConfig(1, 1, None, world),
        OptimizerConfig(lr=3e-3, clip_grad=1.0, adam_eps=0.1),  # adam_eps: test_fsdp_actor.py's why
        ActorConfig(
            max_tokens_per_micro_batch=max_tokens,
            ulysses_size=ulysses,
            activation_checkpointing=recompute,
        ),
        AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01, kl_estimator="k3"),
        temperature=0.8,
    )
    actor.setup()
    batch = random_batch(N, seed=3, prompt_len=(3, 20), response_len=(10, 40))
    metrics, olds = [], []
    for _ in range(STEPS):
        old = actor.compute_logprobs(batch)
        ref = actor.compute_ref_logprobs(batch)
        metrics.append(
            actor.train_step(dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref))
        )
        olds.append(old)
    weights = {k: v.detach().cpu().clone() for k, v in actor.policy.iter_full_tensors()}
    shapes = [tuple(mb["tokens"].shape) for mb in actor._plan(batch)[0]]
    actor.teardown()
    return metrics, olds, weights, shapes


@pytest.fixture(scope="module")
def reference(hf_model):
    return run_on_ranks(_body, 1, args=(hf_model, 1, 1, 160), timeout_s=300)[0]


# u2_dp2 recomputes activations in the backward (actor.activation_checkpointing): the recomputed attention
# trades the sequence split for the head split again
@pytest.mark.parametrize(
    "world, ulysses, budget, recompute",
    [(2, 2, 80, False), (4, 2, 80, True)],
    ids=["u2", "u2_dp2_recompute"],
)
def test_ulysses_equals_one_process(hf_model, reference, world, ulysses, budget, recompute):
    ref_metrics, ref_olds, ref_weights, ref_shapes = reference
    results = run_on_ranks(
        _body, world, args=(hf_model, world, ulysses, budget, recompute), timeout_s=300
    )
    for rank, (metrics, olds, weights, shapes) in enumerate(results):
        assert all(s[1] <= budget for s in shapes), shapes  # each rank holds half of each row
        if world == ulysses:  # one group: the reference's micro-batches, halved
            assert [s[1] * ulysses for s in shapes] == [
                -(-r[1] // ulysses) * ulysses for r in ref_shapes
            ]
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
        w = max((weights[k] - v).abs().max().item() for k, v in ref_weights.items())
        print(
            f"ulysses {ulysses} world {world} rank {rank}: metrics relative {rel:.2e}, old log-probs {lp:.2e}, "
            f"weights {w:.2e}"
        )
        # measured 1.5e-6, 4.8e-7, 7.5e-9
        assert rel <= 1e-5 and lp <= 5e-6 and w <= 1e-7, (rank, rel, lp, w)
        assert all(g["tokens"] == r["tokens"] for g, r in zip(metrics, ref_metrics))
