"""The RL driver: ``rlmega train CONFIG [key=value ...]`` or ``python -m rlmega.train CONFIG ...``.

With no ``cluster.address`` it starts an embedded local Ray; with one it attaches. Per step: the
producer's batch (prompts -> n judged responses each; produce.strategy=async makes it while earlier steps
train) -> old/ref log-probs -> advantages -> train step(s) -> sync weights to the engines -> evaluate
every m steps -> log -> checkpoint every k steps.
``trainer.resume=auto`` (or ``--resume``) continues from RUN_DIR's latest checkpoint exactly;
``trainer.resume=PATH`` starts from that checkpoint (of this run or another).

Under ``python -m rlmega.launch.torchrun --standalone --nproc-per-node K -m rlmega.train CONFIG ...``
(torchrun with its stores on loopback; plain ``torchrun`` works too) the trainer ranks are torchrun's
processes: rank 0 runs this driver loop, the others serve its calls (launch/torchrun_group.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from pathlib import Path

# `python -m rlmega.train` starts its process here: imports uncollected (rlmega/process/heap.py)
if __name__ == "__main__":
    gc.disable()

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from rlmega.config import ConfigError, RLConfig, dump_config, load_config
from rlmega.config.resolved import task_configs, teacher_identities
from rlmega.config.schema import TrainerConfig
from rlmega.agents.produce import Producer
from rlmega.agents.tasks import Tasks
from rlmega.launch import torchrun_group
from rlmega.launch.cluster import ClusterError
from rlmega.launch.errors import WorkerFailed
from rlmega.launch.coordinator import ActorManager
from rlmega.launch.roles import Roles
from rlmega.learner.actor_api import Actor
from rlmega.learner.critic_api import Critic
from rlmega.rundir.checkpoint_files import CheckpointSpaceError
from rlmega.preflight import preflight
from rlmega.rundir.profiling import profiled
from rlmega.rundir.run import (
    ResumeError,
    RunDir,
    changed_settings,
    critic_checkpoint,
    refuse_a_held_folder,
    resume_settings,
)
from rlmega.step import evaluate, rl_step, sft_batch
from rlmega.sync.parity import ParityError, ParityGuard
from rlmega.rundir.startup import StartupClock
from rlmega.rundir.stopping import StopRequest
from rlmega.train_args import parse
from rlmega.judgers.base import RewardError

log = logging.getLogger("rlmega")

# Exit codes of `rlmega train` (docs/troubleshooting.md).
EXIT_OK, EXIT_RUNTIME, EXIT_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


# What a worker raises on purpose, with a message that says it all: no traceback for these.
EXPECTED_WORKER_ERRORS = (RewardError, FloatingPointError, CheckpointSpaceError)


class InputError(RuntimeError):
    """A problem with what the user gave (data rows, files) found after the config checks."""


def train(cfg: RLConfig, clock: StartupClock | None = None) -> RunDir:
    """The run of ``cfg``; ``clock``: its start-up phases so far (default: from this process's start)."""
    t = cfg.trainer
    clock = clock or StartupClock()
    if t.resume == "none":
        refuse_a_held_folder(t.run_dir)  # before RunDir repairs metrics or opens writers there
    run = RunDir(
        t.run_dir,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project,
        config=dataclasses.asdict(cfg),
    )
    try:
        _train(cfg, run, clock)
    finally:  # the TensorBoard / wandb writers flush and close on errors and interrupts too
        run.close()
        draw_curves(run)  # at the end, on a stop, and after a failure that left steps behind
    return run


def draw_curves(run: RunDir) -> None:
    """RUN_DIR/curves.png from the metrics file. A failure here is logged, never raised: it must not
    hide the error a failed run is ending with, nor fail a run that trained."""
    try:
        if not run.read_metrics():  # nothing logged (a run that failed before its first step)
            return
        from rlmega.rundir.plots import plot_run

        print(f"rlmega: curves {plot_run(run.path)}", flush=True)
    except Exception as e:  # noqa: BLE001 -- any drawing problem, as the docstring says
        log.warning(
            "could not draw %s/curves.png (%s: %s); `rlmega plot %s` draws it from metrics.jsonl",
            run.path,
            type(e).__name__,
            e,
            run.path,
        )


def _train(cfg: RLConfig, run: RunDir, clock: StartupClock) -> None:
    t = cfg.trainer
    # checked complete here, before any worker loads it
    checkpoint = run.checkpoint_to_resume(t.resume)
    if (
        checkpoint
        and cfg.algorithm.advantage_estimator == "gae"
        and not critic_checkpoint(checkpoint).is_dir()
    ):
        raise ResumeError(
            f"{checkpoint} has no critic checkpoint ({critic_checkpoint(checkpoint)} is missing): it "
            "was not saved by a run with algorithm.advantage_estimator=gae. Fix: resume it with its own "
            "estimator, or start a new run (trainer.run_dir) from its policy (model.path)"
        )
    settings = resume_settings(cfg.optimizer, t.total_steps, teacher_identities(cfg))
    changed = changed_settings(checkpoint, settings) if checkpoint else []
    if changed:
        log.warning(
            "resuming with settings that differ from the checkpoint's; the new values are used (the LR "
            "schedule continues at the checkpoint's step count): %s",
            ", ".join(changed),
        )
    run.write_config(dump_config(cfg))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    try:
        # every task's prompts (cfg.tasks, or data + agent_loop)
        data = Tasks(
            task_configs(cfg),
            tokenizer,
            prompts_per_step=t.prompts_per_step,
            model_path=cfg.model.path,
            rollout=cfg.rollout,
        )
    # a bad row, an unreadable file: the user's input, named by file and row
    except (ValueError, OSError) as e:
        raise InputError(f"prompt data: {e}") from e
    clock.done("tokenizer and prompts")
    stop = StopRequest(run.path)  # SIGTERM / SIGINT / SIGUSR1 / `rlmega stop RUN_DIR`
    evals = sum(len(prompts) for prompts in data.eval_prompts().values())
    # the handlers go in after Ray's start-up, which installs its own
    with Roles(cfg, clock=clock, eval_requests=evals) as roles, stop:
        start, history, produced = resume(roles, run, data, checkpoint)
        if checkpoint:
            clock.done("checkpoint load")
        warm = {}  # the warm start's first and last loss, into the first RL step's row
        if start == 0 and t.warmup_sft_steps:
            losses = warm_start(roles, data, tokenizer, t, stop)
            run.write_warm_start(losses)
            warm = (
                {"warmup_sft_loss_first": losses[0], "warmup_sft_loss_last": losses[-1]}
                if losses
                else {}
            )
            # KL regularises toward the policy RL starts from, not the untuned model.path.
            roles.call_policy(Actor.update_ref_policy, 1.0)
            clock.done("warm start")
        roles.sync_weights(version=start)
        clock.done("first weight sync")
        # the baseline the run is judged against
        if start == 0 and t.eval_every and data.eval_prompts():
            history.append(
                {"step": 0, **evaluate(roles, data.eval_prompts(), cfg.rollout.max_response_tokens)}
            )
            run.log(history[-1])
            clock.done("baseline eval")
            print(
                f"rlmega: held-out greedy reward before RL (eval_accuracy): {history[-1]['eval_accuracy']:.3f}",
                flush=True,
            )
        clock.write(run.path)  # RUN_DIR/setup.json
        print(
            f"rlmega: dashboard http://{cfg.logging.dashboard_host}:{roles.manager.get_dashboard_port()}/ "
            f"| metrics {run.metrics_path} | checkpoints {run.checkpoints}",
            flush=True,
        )
        # sync, or async: it generates while we train
        with Producer(
            roles.generation(), data, cfg.produce, cfg.algorithm, t, cfg.rollout, start, produced
        ) as producer:
            producer.advance(start)
            bar = tqdm(
                range(start, t.total_steps),
                initial=start,
                total=t.total_steps,
                desc="rl",
                unit="step",
            )
            done = saved = start
            r = cfg.rollout
            guard = ParityGuard(cfg.model.dtype, r.parity_warn, r.parity_stop, r.top_p, r.top_k)
            for step in bar:
                if stop.requested() or roles.manager.should_stop():
                    # the producer polls it: no new batch starts
                    roles.manager.set_should_stop(True)
                    break
                with profiled(roles, run.path / "profile", step + 1, cfg.logging.profile_steps):
                    metrics = rl_step(roles, producer, step, cfg, data.names)
                if metrics is None:  # should_stop came while waiting: the batch was never made
                    break
                if cfg.actor.ref_update_rate > 0:  # Polyak: the reference trails the policy
                    roles.call_policy(Actor.update_ref_policy)
                if t.eval_every and data.eval_prompts() and (step + 1) % t.eval_every == 0:
                    metrics.update(
                        evaluate(roles, data.eval_prompts(), cfg.rollout.max_response_tokens)
                    )
                report(roles.manager, metrics, t.total_steps)
                metrics, warm = {**warm, **metrics}, {}
                history.append({k: v for k, v in metrics.items() if not k.startswith("_")})
                run.log(history[-1])
                bar.set_postfix(
                    reward=f"{metrics['reward_mean']:.3f}",
                    kl=f"{metrics['kl_ref']:.2e}",
                    **(
                        {"eval": f"{metrics['eval_accuracy']:.3f}"}
                        if "eval_accuracy" in metrics
                        else {}
                    ),
                )
                done = step + 1
                # warns past rollout.parity_warn; a reason to stop past parity_stop
                halt = guard(metrics)
                if halt or t.save_every and (done % t.save_every == 0 or done == t.total_steps):
                    saved = save(
                        roles, run, done, data, producer, history, t.keep_last_checkpoints, settings
                    )
                if halt:
                    raise ParityError(
                        f"{halt}. Checkpoint of step {done}: {run.latest_checkpoint()}"
                    )
                # the engines hold weights `done`: the schedule's next batches may start
                producer.advance(done)
            if done < t.total_steps:  # stopped on request: keep every finished step, then leave
                if done > saved:
                    save(
                        roles, run, done, data, producer, history, t.keep_last_checkpoints, settings
                    )
                run.stopped = (
                    f"stopped at step {done} of {t.total_steps} ({stop.reason or 'should_stop'})"
                )
            else:
                roles.call_policy(Actor.export_hf, str(run.path / "hf_final"), True)
                if roles.has_critic:  # a critic to start the next run from (critic.path)
                    roles.call_critic(Critic.export_hf, str(run.path / "critic_hf_final"), True)


def save(
    roles: Roles,
    run: RunDir,
    step: int,
    data: Tasks,
    producer: Producer,
    history: list,
    keep: int,
    settings: dict,
) -> int:
    """Checkpoint after ``step`` RL steps: model, optimizer, RNG, metrics history, and the producer's
    state (buffered batches, the next batch) with the data position it drew to (nothing in production);
    ``settings`` (runs.resume_settings) lets a resume say which of them the config changed."""
    producer.pause()  # until the next advance
    extra = {
        "data": data.state_dict(),
        "history": history,
        "producer": producer.state_dict(),
        "settings": settings,
    }
    if roles.has_critic:  # first: the policy's save writes `latest`, which commits the pair
        roles.call_critic(Critic.save_checkpoint, str(run.checkpoints / "critic"), step)
    roles.call_policy(Actor.save_checkpoint, str(run.checkpoints), step, extra)
    run.prune_checkpoints(keep)
    return step


def resume(
    roles: Roles, run: RunDir, data: Tasks, path: Path | None
) -> tuple[int, list, dict | None]:
    """(first step to run, metrics history, producer state) from the complete checkpoint ``path``
    (RunDir.checkpoint_to_resume), or (0, [], None) with an empty metrics file."""
    if path is None:
        earlier = len(run.read_metrics())
        # resume=auto where an attempt saved no checkpoint: its steps are redone, not repeated
        if earlier:
            print(
                f"rlmega: no checkpoint in {run.checkpoints}: starting at step 0; the earlier attempt's "
                f"{earlier} lines in {run.metrics_path} are replaced",
                flush=True,
            )
            run.rewrite_metrics([])
        return 0, [], None
    if roles.has_critic:  # there: _train checked it before any worker started
        roles.call_critic(Critic.load_checkpoint, str(critic_checkpoint(path)))
    step, extra = roles.call_policy(Actor.load_checkpoint, str(path))
    data.load_state_dict(extra["data"])
    run.rewrite_metrics(extra["history"])
    print(f"rlmega: resumed from {path} at step {step}", flush=True)
    return step, list(extra["history"]), extra.get("producer")  # checkpoints before async have none


def warm_start(
    roles: Roles, data: Tasks, tokenizer, t: TrainerConfig, stop: StopRequest
) -> list[float]:
    """A short supervised warm start on the prompts' labels (random weights learn nothing by RL):
    ``t.warmup_sft_steps`` steps at ``t.warmup_sft_lr``, targets cut to ``t.warmup_sft_max_tokens``.
    Returns each step's loss.

    A stop request ends it early; the run then stops before RL with no checkpoint (a resume would
    start over, as the warm start belongs to step 0)."""
    steps = t.warmup_sft_steps
    losses: list[float] = []
    bar = tqdm(range(steps), desc="sft warm start", unit="step", disable=steps == 0)
    for i in bar:
        if stop.requested():
            return losses
        loops = {name: data.config(name).agent_loop for name in data.names}
        batch = sft_batch(
            data.warmup_prompts(i), tokenizer, loops, t.warmup_sft_max_tokens, data.processor
        )
        metrics = roles.call_policy(Actor.sft_step, batch, t.warmup_sft_lr)
        losses.append(float(metrics["loss"]))
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
    return losses


def report(manager: ActorManager, metrics: dict, total_steps: int) -> None:
    manager.report_metrics(
        metrics["step"], {k: v for k, v in metrics.items() if not k.startswith("_")}
    )
    manager.report_progress(metrics["step"], total_steps)
    manager.report_token_statistics(
        metrics["_prefill_tokens"], metrics["_decode_tokens"], metrics["time_generate"]
    )
    manager.report_training_step_time(metrics["step"], metrics["time_train"])
    manager.report_batch_generation_time(metrics["step"], metrics["time_generate"])
    manager.report_staleness(
        metrics["step"],
        {int(k.split("/")[1]): int(v) for k, v in metrics.items() if k.startswith("staleness/")},
    )
    manager.report_busy(
        metrics["step"], metrics["engine_busy_fraction"], metrics["trainer_busy_fraction"]
    )


def main(argv=None) -> int:
    rank = torchrun_group.rank()  # None unless torchrun started this process
    if rank:  # ranks 1..: serve rank 0, the driver (launch/torchrun_group.py)
        return torchrun_group.serve()
    try:
        return _main(argv)
    finally:
        if rank == 0:  # whatever happened, let the serving ranks go
            torchrun_group.release_ranks()


def _main(argv=None) -> int:
    clock = StartupClock()  # t = 0: this process's start
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    clock.done("imports")
    try:
        cfg = load_config(
            args.config, [*args.overrides, *(["trainer.resume=auto"] if args.resume else [])]
        )
        # every rlmega.* logger of the driver
        logging.getLogger("rlmega").setLevel(cfg.logging.level)
        preflight(cfg)  # model, reward fn, data files, run dir, devices: before any worker starts
    except ConfigError as e:
        print(f"rlmega: {e}", file=sys.stderr)
        return EXIT_INPUT
    clock.done("config checks")
    try:
        # the log's lines print above the progress bar, not into its line
        with logging_redirect_tqdm():
            run = train(cfg, clock)
    # reward.on_error=fail and a judger failed; the parity guard
    except (RewardError, ParityError) as e:
        print(f"rlmega: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    # ClusterError: too few nodes, or folders the nodes do not share
    except (InputError, ClusterError, ResumeError) as e:
        print(f"rlmega: {e}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("rlmega: interrupted; every worker was released", file=sys.stderr)
        return EXIT_INTERRUPTED
    except WorkerFailed as e:  # RoleDied, or a trainer rank failing while Roles starts them
        print(f"rlmega: {e}; every other worker was released", file=sys.stderr)
        # a bug: keep its traceback
        if e.remote_traceback and not isinstance(e.cause, EXPECTED_WORKER_ERRORS):
            print(f"--- traceback in {e.worker} ---\n{e.remote_traceback}", file=sys.stderr)
        return EXIT_RUNTIME
    if run.stopped:
        print(
            f"rlmega: {run.stopped}; checkpoint {run.latest_checkpoint()}, every worker released. "
            f"Continue with: rlmega train {args.config} ... --resume",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    print(f"rlmega: done. metrics {run.metrics_path}, final policy {run.path / 'hf_final'}")
    return EXIT_OK


if __name__ == "__main__":
    from rlmega.process.heap import settle
    from rlmega.launch.process_exit import leave

    settle()  # the imports above are done: frozen, and the collector back on
    leave(main())
