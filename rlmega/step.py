"""One RL step, as the driver runs it: generate, reward, log-probs, advantages, train, sync.

The roles (actor ranks, engines, reward workers) do the work; this file only moves data between
them and times each phase. ``rl_step`` returns the step's metrics (see README for the keys).
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch

from rlmega.algorithms import advantages as adv_lib
from rlmega.algorithms import kl as kl_lib
from rlmega.data.rollout_batch import RolloutBatch
from rlmega.data.samples import batch_from_samples
from rlmega.sync.parity import logprob_diff

_SEED_STRIDE = 1_000_003  # per-step engine seeds: far apart, reproducible on resume


class Timers(dict):
    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time_{name}"] = time.perf_counter() - start


def sample_seed(base: int, step: int) -> int:
    return base + step * _SEED_STRIDE


def rl_step(roles, prompts: list, step: int, cfg, tokenizer) -> dict:
    """prompts: data.prompts.Prompt items (token_ids, label). Returns the step's metrics."""
    a, t = cfg.algorithm, Timers()
    start = time.perf_counter()
    with t("generate"):
        samples = roles.generate([p.token_ids for p in prompts], seed=sample_seed(cfg.rollout.seed, step))
    roles.train_phase()  # colocated GPUs: engines sleep, the trainer onloads (no-ops otherwise)
    with t("reward"):
        texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=False)
        rewards, reward_errors = roles.score([(text, prompts[s.prompt_index].label) for text, s in zip(texts, samples)])
    batch = batch_from_samples(samples, rewards)
    n_mini = max(1, len(batch) // cfg.trainer.global_batch_size)  # optimizer steps in this RL step
    kl_reward = a.kl_coef > 0 and a.kl_in_reward  # needs the old log-probs before the advantages
    # One optimizer step: the policy before it scores the train forward itself, so train_step takes
    # the old log-probs from there (detached) instead of a separate forward, and returns them.
    on_policy = n_mini == 1 and not kl_reward
    with t("logprob"):
        old = None if on_policy else roles.call_actors("compute_logprobs", batch)
        ref = roles.call_actors("compute_ref_logprobs", batch) if a.kl_coef > 0 else None
    seq_rewards = batch.rewards.clone()
    if kl_reward:  # KL as a per-sequence reward penalty
        seq_rewards -= a.kl_coef * torch.stack([kl_lib.kl_penalty(o, r, a.kl_estimator).sum() for o, r in zip(old, ref)])
    seq_adv = adv_lib.compute(a.advantage_estimator, seq_rewards, batch.group_ids)
    batch = dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref,
                                advantages=[torch.full((n,), float(x)) for n, x in zip(batch.response_lens(), seq_adv)])
    with t("train"):
        train = [roles.call_actors("train_step", mini, optimizer_steps_per_rl_step=n_mini)
                 for mini in batch.split(n_mini) if len(mini)]
    if on_policy:
        old = train[0].pop("old_logprobs")  # the policy's before this step's update, as compute_logprobs gives
    with t("sync"):
        roles.rollout_phase(version=step + 1)  # trainer offloads, engines wake, weights sync
    parity = logprob_diff(batch.rollout_logprobs, old, batch.response_mask)
    tokens = batch.num_tokens()
    t["time_step"] = time.perf_counter() - start
    return {
        "step": step + 1,
        "reward_mean": float(batch.rewards.mean()), "reward_std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        "response_length": float(sum(batch.response_lens()) / max(len(batch), 1)),
        **{k: sum(m[k] for m in train) / len(train) for k in ("loss", "pg_clipfrac", "ppo_kl", "kl_ref", "entropy",
                                                             "grad_norm", "padding_fraction", "rollout_is_ratio",
                                                             "rollout_is_truncated", "rollout_is_masked")},
        "lr": train[-1]["lr"], "skipped_steps": sum(m["skipped"] for m in train),
        "logprob_diff_max": parity["max"], "logprob_diff_mean": parity["mean"],
        "reward_errors": sum(e is not None for e in reward_errors),
        "tokens_per_s": tokens / t["time_step"], **t,
        "_prefill_tokens": sum(len(s.prompt_ids) for s in samples), "_decode_tokens": sum(len(s.response_ids) for s in samples),
    }


def evaluate(roles, prompts: list, tokenizer, max_tokens: int) -> float:
    """Greedy accuracy: the mean reward of one temperature-0 answer per prompt."""
    samples = roles.generate([p.token_ids for p in prompts], seed=0, n=1, temperature=0.0, max_tokens=max_tokens)
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=False)
    rewards, _ = roles.score([(text, prompts[s.prompt_index].label) for text, s in zip(texts, samples)])
    return float(sum(rewards) / max(len(rewards), 1))


def sft_batch(prompts: list, tokenizer) -> RolloutBatch:
    """Prompts with their labels (+ eos) as the responses: a supervised warm-start batch."""
    tokens, plens = [], []
    for p in prompts:
        answer = tokenizer.encode(str(p.label), add_special_tokens=False) + [tokenizer.eos_token_id]
        tokens.append(torch.tensor(list(p.token_ids) + answer, dtype=torch.int64))
        plens.append(len(p.token_ids))
    n = len(prompts)
    return RolloutBatch(tokens=tokens, prompt_lens=torch.tensor(plens),
                        response_mask=[torch.ones(len(x) - p) for x, p in zip(tokens, plens)],
                        group_ids=torch.arange(n), sample_ids=torch.arange(n))
