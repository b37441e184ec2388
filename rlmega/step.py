"""One RL step, as the driver runs it: take the step's judged batch from the producer, log-probs,
advantages, train, sync.

The roles (actor ranks, engines, agent loops and their judgers) do the work and the producer
(rlmega/agents/produce.py) makes the batches; this file only moves data between them and times each
phase. ``rl_step`` returns the step's metrics (docs/troubleshooting.md lists the keys).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import TYPE_CHECKING
from contextlib import contextmanager

import torch

from rlmega.learner.actor_api import Actor, advantages_and_returns
from rlmega.learner.critic_api import Critic
from rlmega.algorithms import advantages as adv_lib
from rlmega.algorithms import kl as kl_lib
from rlmega.algorithms import opd
from rlmega.agents.metrics import rollout_metrics, staleness_metrics
from rlmega.agents.produce import group_requests
from rlmega.agents.sft import sft_example
from rlmega.config.resolved import task_configs
from rlmega.agents.trajectory import batch_from_groups, kept_trajectories, staleness
from rlmega.algorithms import dapo
from rlmega.data.images import processor_vision
from rlmega.data.packing import mini_batch_count
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.judgers.base import RewardError
from rlmega.sync.parity import logprob_diff, on_policy_diff
from rlmega.rollout.engine_errors import engine_death_in

# the driver's types; at run time step.py needs neither Ray nor the producer's loop
if TYPE_CHECKING:
    from rlmega.agents.produce import Producer
    from rlmega.config.schema import RLConfig
    from rlmega.launch.roles import Roles

log = logging.getLogger("rlmega")
TRUNCATED = ("length", "max_tokens")  # finish reasons of a response cut at its token budget


class Timers(dict):
    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time_{name}"] = time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one RL step runs, decided from its batch's size and the config."""

    n_mini: int  # optimizer steps in this RL step
    # KL as a per-sequence reward penalty: needs the old log-probs before the advantages
    kl_reward: bool
    gae: bool  # PPO with a value model: per-token advantages from its values (GAE)
    policy_trains: bool  # critic warm-up: the first k steps train the critic alone
    # one optimizer step: train_step scores the old log-probs itself (detached), no forward of its own
    on_policy: bool
    # on-policy distillation: the teachers score the batch; their signal needs the old log-probs first
    distill: bool

    @staticmethod
    def of(roles: Roles, cfg: RLConfig, step: int, batch_size: int) -> StepPlan:
        a = cfg.algorithm
        n_mini = mini_batch_count(batch_size, cfg.trainer.global_batch_size)
        kl_reward, gae = a.kl_coef > 0 and a.kl_in_reward, roles.has_critic
        policy_trains = not gae or step >= cfg.critic.warmup_steps
        distill = bool(cfg.distillation.teachers)
        on_policy = n_mini == 1 and not kl_reward and policy_trains and not distill
        return StepPlan(n_mini, kl_reward, gae, policy_trains, on_policy, distill)


def rl_step(
    roles: Roles, producer: Producer, step: int, cfg: RLConfig, task_names: list[str]
) -> dict | None:
    """Train on batch ``step`` from the producer (rlmega/agents/produce.py), then sync the new weights.
    Returns the step's metrics; None when production stopped (should_stop) before the batch was made."""
    t, start, busy = Timers(), time.perf_counter(), roles.engine_busy_seconds()
    # sync: the batch's generation and judging; async: what of it training did not hide
    with t("wait"):
        produced = producer.take(step)
    if produced is None:
        return None
    roles.train_phase()  # colocated GPUs: engines sleep, the trainer onloads (no-ops otherwise)
    judge_failures = checked_judgements(produced.groups, step, cfg.reward.on_error)
    # the judges' rewards, every sampled token: the metrics'
    generated = trainable_batch(produced.groups, step)
    rows = [(g.task, x) for g, x in kept_trajectories(produced.groups)]
    batch, shaping = shape_overlong(generated, rows, cfg)
    plan = StepPlan.of(roles, cfg, step, len(batch))
    with t("logprob"):
        batch = scored(roles, batch, plan, cfg.algorithm.kl_coef > 0)
    with t("teacher"):  # on-policy distillation: each teacher scores its tasks' samples
        taught = (
            teacher_scored(roles, batch, [task for task, _ in rows], cfg) if plan.distill else []
        )
    batch = with_advantages(batch, plan, cfg.algorithm, taught, cfg.distillation.coef)
    with t("train"):
        train, critic = trained(roles, batch, plan)
    # the policy's before the update
    old = train[0].pop("old_logprobs") if plan.on_policy else batch.old_logprobs
    with t("sync"):  # trainer offloads, engines wake, weights sync (async: as the schedule allows)
        synced = producer.sync(step + 1)
    t["time_step"] = time.perf_counter() - start
    # the batch's own production, overlapped or not
    t["time_generate"] = produced.stats["time_generate"]
    busy_fraction = (roles.engine_busy_seconds() - busy) / (
        t["time_step"] * max(len(roles.engines), 1)
    )
    return {
        **step_metrics(step, produced, generated, batch, old, train, critic, plan.gae, task_names),
        **{f"judge_errors/{k}": v for k, v in judge_failures.items()},
        **shaping,
        **(distill_metrics(batch, taught) if plan.distill else {}),
        **synced,
        "engine_busy_fraction": min(
            1.0, max(0.0, busy_fraction)
        ),  # the engines' clocks against the driver's
        "trainer_busy_fraction": min(1.0, (t["time_logprob"] + t["time_train"]) / t["time_step"]),
        "tokens_per_s": batch.num_tokens() / t["time_step"],
        **t,
    }


def checked_judgements(groups: list, step: int, on_error: str) -> dict:
    """Ends the run on a failed judgement under reward.on_error=fail (check_judgements); under zero, says how
    many items each judger failed on (scored 0: said, not hidden) and returns those counts."""
    check_judgements(groups, on_error)
    failures = judge_error_counts(groups)
    if failures:
        log.warning(
            "step %d: a judger failed on %d trajectories, scored 0 (reward.on_error=zero): %s; first: %s",
            step + 1,
            sum(failures.values()),
            ", ".join(f"{k} {v}" for k, v in failures.items()),
            next(
                x.judge_error
                for g in groups
                if g.error is None
                for x in g.trajectories
                if x.judge_error is not None
            )[:500],
        )
    return failures


def trainable_batch(groups: list, step: int) -> RolloutBatch:
    """The batch of the kept groups' trajectories; an error naming the engines' failure when none is left."""
    batch = batch_from_groups(groups)
    if len(batch) == 0:
        died = next((d for g in groups if g.error for d in [engine_death_in(g.error)] if d), None)
        raise RuntimeError(
            f"step {step + 1}: every group was dropped ({[g.error for g in groups][:3]} ...): "
            "the engines fail every request: "
            + (
                died
                or "see the engine logs (Ray's worker logs under /tmp/ray/session_latest/logs/)"
            )
        )
    return batch


def scored(roles: Roles, batch: RolloutBatch, plan: StepPlan, with_ref: bool) -> RolloutBatch:
    """The batch with the old policy's log-probs (unless train_step scores them: plan.on_policy), the reference's
    (``with_ref``: KL on) and the critic's values (plan.gae: on its own ranks, beside the actor's forwards)."""
    values_wait = roles.submit_critic(Critic.compute_values, batch) if plan.gae else None
    old = None if plan.on_policy else roles.call_policy(Actor.compute_logprobs, batch)
    ref = roles.call_policy(Actor.compute_ref_logprobs, batch) if with_ref else None
    values = values_wait() if values_wait else None
    return dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref, old_values=values)


def teacher_scored(
    roles: Roles, batch: RolloutBatch, tasks: list[str], cfg: RLConfig
) -> list[tuple[float, list]]:
    """(weight, per sample log-probs or None) of each distillation teacher: teacher i scores the samples of
    its tasks (distillation.teachers[i].tasks; all when empty), on the trainer ranks at the policy's layout."""
    out = []
    for i, teacher in enumerate(cfg.distillation.teachers):
        picked = [s for s, task in enumerate(tasks) if not teacher.tasks or task in teacher.tasks]
        per_sample: list = [None] * len(batch)
        if picked:
            lps = roles.call_policy(Actor.compute_teacher_logprobs, batch.select(picked), i)
            for s, lp in zip(picked, lps):
                per_sample[s] = lp
        out.append((teacher.weight, per_sample))
    return out


def distill_metrics(batch: RolloutBatch, taught: list[tuple[float, list]]) -> dict:
    """distill_kl: the k1 estimate of KL(student || teacher) on the scored samples' loss tokens, the teachers'
    weighted mean; distill_kl/<i> each teacher's when there are several."""
    kls = [
        opd.reverse_kl(batch.old_logprobs, per_sample, batch.response_mask)
        for _, per_sample in taught
    ]
    # a teacher that scored no sample has kl nan
    scored = [(w, kl) for (w, _), kl in zip(taught, kls) if kl == kl]
    out = {
        "distill_kl": sum(w * kl for w, kl in scored) / sum(w for w, _ in scored)
        if scored
        else float("nan")
    }
    if len(taught) > 1:
        out.update({f"distill_kl/{i}": kl for i, kl in enumerate(kls)})
    return out


def with_advantages(
    batch: RolloutBatch, plan: StepPlan, a, taught: list | None = None, coef: float = 1.0
) -> RolloutBatch:
    """Per-token advantages: GAE from the critic's values (plan.gae), else the estimator's per-sequence advantage
    on every response token, the rewards less the sequence KL first when KL is a reward penalty; then the
    distillation signal of ``taught`` (teacher_scored) added, scaled by ``coef`` (alone under opd)."""
    if taught:
        signal = opd.token_signal(batch.old_logprobs, taught, coef)
        if a.advantage_estimator == "opd":
            return dataclasses.replace(batch, advantages=signal)
        rewarded = with_advantages(batch, plan, a)
        return dataclasses.replace(
            rewarded, advantages=[x + y for x, y in zip(rewarded.advantages, signal)]
        )
    if plan.gae:
        # here: pure arithmetic, no trainer rank
        advantages, returns = advantages_and_returns(batch, a)
        return dataclasses.replace(batch, advantages=advantages, returns=returns)
    seq_rewards = batch.rewards.clone()
    # KL as a per-sequence reward penalty, over the tokens the loss trains on (not tool output)
    if plan.kl_reward:
        seq_rewards -= a.kl_coef * kl_lib.sequence_kl(
            batch.old_logprobs, batch.ref_logprobs, batch.response_mask, a.kl_estimator
        )
    seq_adv = adv_lib.compute(a.advantage_estimator, seq_rewards, batch.group_ids)
    return dataclasses.replace(
        batch,
        advantages=[torch.full((n,), float(x)) for n, x in zip(batch.response_lens(), seq_adv)],
    )


def trained(roles: Roles, batch: RolloutBatch, plan: StepPlan) -> tuple[list[dict], list[dict]]:
    """The policy's and the critic's train_step results, one per mini-batch (the critic's on its own ranks,
    beside the policy's)."""
    minis = [mini for mini in batch.split(plan.n_mini) if len(mini)]
    critic_waits = (
        [roles.submit_critic(Critic.train_step, mini) for mini in minis] if plan.gae else []
    )
    train = (
        [
            roles.call_policy(Actor.train_step, mini, optimizer_steps_per_rl_step=plan.n_mini)
            for mini in minis
        ]
        if plan.policy_trains
        else []
    )
    # A short batch (stale drops, short dynamic sampling) took fewer optimizer steps than the LR
    # schedule plans per RL step: move it on by the rest, so it ends with trainer.total_steps.
    behind = roles.optimizer_steps_per_rl_step() - plan.n_mini
    if behind > 0 and plan.policy_trains:
        roles.call_policy(Actor.advance_lr_schedule, behind)
    return train, [wait() for wait in critic_waits]


def step_metrics(
    step: int,
    produced,
    generated: RolloutBatch,
    batch: RolloutBatch,
    old,
    train: list[dict],
    critic: list[dict],
    gae: bool,
    task_names: list[str],
) -> dict:
    """The step's row (docs/troubleshooting.md lists the keys) apart from timings, shaping and the sync's: the
    judges' rewards over every sampled token (``generated``), the train and critic steps' means, the parity of the
    engine's log-probs with the trainer's ``old`` ones, and the producer's counts."""
    groups, stats = produced.groups, produced.stats
    rollout = rollout_metrics(groups, task_names)
    parity = logprob_diff(batch.rollout_logprobs, old, batch.response_mask)
    # The guard's measure: only samples the current weights made must agree (async ones may be stale).
    fresh = on_policy_diff(
        batch.rollout_logprobs,
        old,
        batch.response_mask,
        [staleness(x, step) == 0 for _, x in kept_trajectories(groups)],
    )
    return {
        "step": step + 1,
        "reward_mean": float(generated.rewards.mean()),
        "reward_std": float(generated.rewards.std()) if len(batch) > 1 else 0.0,
        "response_length": float(sum(batch.response_lens()) / max(len(batch), 1)),
        **mean_of(
            train,
            (
                "loss",
                "pg_clipfrac",
                "ppo_kl",
                "kl_ref",
                "entropy",
                "grad_norm",
                "padding_fraction",
                "rollout_is_ratio",
                "rollout_is_truncated",
                "rollout_is_masked",
            ),
        ),
        **moe_metrics(train),
        **mean_of(critic, critic[0] if critic else ()),
        **(gae_metrics(batch) if gae else {}),
        "lr": train[-1]["lr"] if train else float("nan"),
        "skipped_steps": sum(m["skipped"] for m in train),
        "logprob_diff_max": parity["max"],
        "logprob_diff_mean": parity["mean"],
        "parity_max": fresh["max"],
        "parity_samples": fresh["samples"],
        "groups_trained": sum(g.error is None for g in groups),
        "reward_errors": rollout["judge_errors"],
        "generation_failures": stats["generation_failures"],
        **rollout,
        **{
            k: stats[k]
            for k in (
                "sampling_rounds",
                "prompts_drawn",
                "groups_filtered",
                "groups_short",
                "stale_dropped",
                "stale_requeued",
            )
        },
        **staleness_metrics(groups, step),
        "_prefill_tokens": sum(len(x.prompt_ids) for g in groups for x in g.trajectories),
        "_decode_tokens": sum(int(m.sum()) for m in generated.response_mask),
    }


def mean_of(results: list[dict], keys) -> dict:
    """Each key's mean over a step's train_step results (its optimizer steps); NaN when the step took
    none (the policy during critic.warmup_steps)."""
    return {k: sum(m[k] for m in results) / len(results) if results else float("nan") for k in keys}


def gae_metrics(batch: RolloutBatch) -> dict:
    """The critic's values and targets and the policy's advantages over the batch's action tokens (gae)."""
    act = torch.cat([m > 0 for m in batch.response_mask])
    if not act.any():
        return {}
    adv, ret, val = (torch.cat(x)[act] for x in (batch.advantages, batch.returns, batch.old_values))
    return {
        "critic/values_before": float(val.mean()),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "return_mean": float(ret.mean()),
    }


# and every "moe_*" key (expert load, aux/z losses)
MOE_METRICS = ("router_mismatch", "routes_live_fraction")


def moe_metrics(train: list[dict]) -> dict:
    """The mixture-of-experts metrics of a step's train_step results (none for a dense model), averaged
    over its optimizer steps: which keys exist depends on the model (its MoE layers) and the config."""
    keys = [k for k in train[0] if k in MOE_METRICS or k.startswith("moe_")] if train else []
    return {k: sum(m[k] for m in train) / len(train) for k in keys}


def shape_overlong(batch: RolloutBatch, rows: list, cfg: RLConfig) -> tuple[RolloutBatch, dict]:
    """algorithm.overlong on a batch whose rows are ``rows`` [(task, Trajectory)]: "mask" zeroes the
    response mask of responses cut at their budget (out of the loss and its denominators), "penalty"
    adds DAPO's soft length penalty to every reward. The budget of a task's response is its agent loop's
    max_total_tokens, else rollout.max_response_tokens. Returns (batch, metrics)."""
    a = cfg.algorithm
    cut = [t.finish_reason in TRUNCATED for _, t in rows]
    out = {"overlong_fraction": sum(cut) / max(len(rows), 1)}
    if a.overlong == "mask":
        batch = dataclasses.replace(
            batch, response_mask=[m * 0 if c else m for m, c in zip(batch.response_mask, cut)]
        )
    elif a.overlong == "penalty":
        loops = {task.name: task.agent_loop for task in task_configs(cfg)}
        penalty = torch.zeros(len(rows))
        for i, (task, t) in enumerate(rows):
            budget = loops[task].max_total_tokens or cfg.rollout.max_response_tokens
            buffer = min(a.overlong_buffer_tokens or dapo.default_buffer(budget), budget)
            penalty[i] = dapo.overlong_penalty(
                torch.tensor([len(t.response_ids)]), budget, buffer, a.overlong_penalty_factor
            )[0]
        batch = dataclasses.replace(batch, rewards=batch.rewards + penalty)
        out["overlong_penalty_mean"] = float(penalty.mean())
    return batch, out


def evaluate(roles: Roles, eval_prompts: dict, max_tokens: int) -> dict:
    """Greedy accuracy per task: the mean reward of one temperature-0 trajectory per eval prompt, through
    the task's agent loop; "eval_accuracy" is the mean over every task's prompts."""
    picked = [(task, p) for task, prompts in eval_prompts.items() for p in prompts]
    groups = roles.rollout(
        group_requests(picked, 1, 0, dict(temperature=0.0, max_tokens=max_tokens))
    )
    rewards: dict = {task: [] for task in eval_prompts}
    for g in groups:
        # a lost answer is wrong
        rewards[g.task] += [x.reward for x in g.trajectories] if g.error is None else [0.0]
    out = {
        f"task/{k}/eval_accuracy": sum(v) / len(v)
        for k, v in rewards.items()
        if len(eval_prompts) > 1
    }
    out["eval_accuracy"] = sum(sum(v) for v in rewards.values()) / max(
        sum(len(v) for v in rewards.values()), 1
    )
    return out


def judge_error_counts(groups) -> dict:
    """{judger name: trajectories it failed on} over the groups' kept trajectories, judgers without a
    failure left out. A trajectory's judge_error joins its judgers' errors, each "judger 'NAME' (kind): why"
    (rlmega.judgers.base); an error of another form counts under "?"."""
    counts: dict = {}
    for g in groups:
        if g.error is not None:
            continue
        for x in g.trajectories:
            if x.judge_error is None:
                continue
            names = set(re.findall(r"judger '([^']*)' \(", x.judge_error)) or {"?"}
            for name in sorted(names):
                counts[name] = counts.get(name, 0) + 1
    return counts


def check_judgements(groups, on_error: str) -> None:
    """reward.on_error=fail: a trajectory a judger failed on ends the run, naming it. Either way, a batch whose
    every trajectory's judging failed ends it: scored 0 throughout, it would train on nothing but zeros."""
    judged = [(g, x) for g in groups if g.error is None for x in g.trajectories]
    if on_error == "fail":
        for g, x in judged:
            if x.judge_error is not None:
                raise RewardError(
                    f"task {g.task!r}, prompt {g.prompt_index} (label {g.label!r}): {x.judge_error}. "
                    "Fix: correct the judger, or set reward.on_error=zero to score such items 0 "
                    "and go on"
                )
    if judged and all(x.judge_error is not None for _, x in judged):
        g, x = judged[0]
        raise RewardError(
            f"the reward failed on every one of the batch's {len(judged)} trajectories, so the step "
            f"would train on zeros; the first, task {g.task!r}, prompt {g.prompt_index} (label "
            f"{g.label!r}): {x.judge_error}. Fix: correct the reward function (`rlmega check-config` "
            "calls it on a row of the data before any worker starts)"
        )


def sft_batch(
    picked: list, tokenizer, loop_cfgs: dict, max_tokens: int = 0, processor=None
) -> RolloutBatch:
    """[(task, Prompt)] with targets in each task's agent-loop format (rlmega/agents/sft.py: the label +
    EOS, or a calculator call, its masked result and the label): a supervised warm-start batch.
    ``max_tokens`` > 0 cuts each target to its first that many tokens (a cut one loses its EOS). Image prompts
    get their image tensors from ``processor`` (a vision-language model's)."""
    tokens, plens, masks = [], [], []
    vision = [
        processor_vision(processor, p.text, p.images)[0] if p.images else None for _, p in picked
    ]
    for task, p in picked:
        ids, mask = sft_example(list(p.token_ids), p.text, p.label, loop_cfgs[task], tokenizer)
        if max_tokens:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        tokens.append(torch.tensor(list(p.token_ids) + ids, dtype=torch.int64))
        plens.append(len(p.token_ids))
        masks.append(torch.tensor(mask, dtype=torch.float32))
    n = len(picked)
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=torch.tensor(plens),
        response_mask=masks,
        group_ids=torch.arange(n),
        sample_ids=torch.arange(n),
        vision=vision if any(v is not None for v in vision) else None,
    )
