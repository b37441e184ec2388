"""MegatronActor on real gloo ranks: packed log-probs, layout-invariant RL steps, reference, NaN.

One tiny Qwen2 model (QKV bias, vocab 59 padded to 128) and one synthetic RolloutBatch of 10
samples with variable prompt and response lengths and GRPO advantages.
"""

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

N, STEPS, REL = 10, 2, 1e-5


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


def _actor(path, tp=1, pp=1, vpp=None, world=None, max_tokens=40, algorithm=None, **actor_kw):
    """``algorithm``: AlgorithmConfig fields that replace this file's (KL 0.05 k3, entropy 0.01)."""
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.actor import MegatronActor

    sp = actor_kw.pop("sequence_parallel", None)  # null: on at TP > 1
    actor = MegatronActor(
        ModelConfig(path=path),
        ParallelismConfig(tp, pp, vpp, world or tp * pp, sequence_parallel=sp),
        OptimizerConfig(lr=3e-3, clip_grad=1.0),
        ActorConfig(max_tokens_per_micro_batch=max_tokens, **actor_kw),
        AlgorithmConfig(
            **{"kl_coef": 0.05, "entropy_coef": 0.01, "kl_estimator": "k3", **(algorithm or {})}
        ),
        temperature=0.8,
    )
    actor.setup()
    return actor


def _rl_step(actor, batch):
    old = actor.compute_logprobs(batch)
    ref = actor.compute_ref_logprobs(batch)
    return actor.train_step(dataclasses.replace(batch, old_logprobs=old, ref_logprobs=ref)), old


def _train_body(path, tp, pp, vpp, world, max_tokens, actor_kw):
    actor = _actor(path, tp, pp, vpp, world, max_tokens, **actor_kw)
    batch = random_batch(N, seed=1)
    metrics = []
    for _ in range(STEPS):
        m, old = _rl_step(actor, batch)
        metrics.append(m)
    actor.teardown()
    return metrics, old


@pytest.fixture(scope="module")
def reference(hf_model):
    return run_on_ranks(_train_body, 1, args=(hf_model, 1, 1, None, 1, 40, {}), timeout_s=300)[0]


def _assert_same_run(got, ref, what):
    for step, (g, r) in enumerate(zip(got, ref)):
        for key in ("loss", "grad_norm", "pg_loss", "entropy", "kl_ref"):
            assert abs(g[key] - r[key]) <= REL * max(abs(r[key]), 1e-6), (
                f"{what} step {step} {key}: {g[key]} vs {r[key]}"
            )
        assert g["tokens"] == r["tokens"]


def test_step_zero_ratio_is_one_and_kl_is_zero(reference):
    metrics, _ = reference
    m0 = metrics[0]
    assert m0["ppo_kl"] == 0.0 and m0["pg_clipfrac"] == 0.0  # old == current: ratio exactly 1
    assert abs(m0["kl_ref"]) < 1e-8  # reference == policy at step 0
    batch = random_batch(N, seed=1)
    mask = torch.cat(batch.response_mask)
    adv = torch.cat(batch.advantages)
    # ratio 1: the PPO loss of each token is -A, token-mean over the whole batch
    assert abs(m0["pg_loss"] - float(-(adv * mask).sum() / mask.sum())) < 1e-6
    assert m0["skipped"] == 0.0 and math.isfinite(m0["grad_norm"]) and m0["grad_norm"] > 0
    assert metrics[1]["kl_ref"] > 0  # after one step the policy has moved away from the reference


LAYOUTS = {  # name: (tp, pp, vpp, world, max_tokens, actor options)
    "budget_16": (1, 1, None, 1, 16, {}),
    "offload_optimizer": (
        1,
        1,
        None,
        1,
        40,
        {"offload_optimizer": True, "offload_reference": False},
    ),
    "tp2_dp2": (2, 1, None, 4, 40, {}),  # sequence parallel (on at TP > 1)
    "tp2_dp2_no_sp": (2, 1, None, 4, 40, {"sequence_parallel": False}),
    "pp2_dp2": (1, 2, None, 4, 40, {}),
    "tp2_pp2": (2, 2, None, 4, 24, {}),
    "pp2_vpp2_dp2": (1, 2, 2, 4, 24, {}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_train_step_matches_single_process(hf_model, reference, name):
    tp, pp, vpp, world, budget, kw = LAYOUTS[name]
    results = run_on_ranks(
        _train_body, world, args=(hf_model, tp, pp, vpp, world, budget, kw), timeout_s=300
    )
    ref_metrics, ref_old = reference
    for rank, (metrics, old) in enumerate(results):
        worst = max(
            abs(g[k] - r[k]) / max(abs(r[k]), 1e-6)
            for g, r in zip(metrics, ref_metrics)
            for k in ("loss", "grad_norm", "pg_loss", "entropy", "kl_ref")
        )
        print(
            f"{name} rank {rank}: metrics relative {worst:.2e}, old log-probs "
            f"{max((a - b).abs().max().item() for a, b in zip(old, ref_old)):.2e}"
        )
        _assert_same_run(metrics, ref_metrics, f"{name} rank {rank}")
        assert max((a - b).abs().max().item() for a, b in zip(old, ref_old)) <= 1e-5


# ---- one optimizer step per RL step: the old log-probs come from the train forward itself ------

ON_POLICY_CASES = {  # name: (tp, pp, vpp, world, max_tokens, algorithm overrides)
    "budget_16": (1, 1, None, 1, 16, {}),
    "tp2_dp2": (2, 1, None, 4, 40, {}),  # sequence parallel (on at TP > 1)
    "tp2_pp2": (2, 2, None, 4, 24, {}),
    "pp2_vpp2_dp2": (1, 2, 2, 4, 24, {}),
    # the entropy only a metric (computed without a graph), rollout correction weighting the loss
    "tis_no_entropy_bonus": (1, 1, None, 1, 16, {"entropy_coef": 0.0, "rollout_correction": "tis"}),
}


def _on_policy_body(path, tp, pp, vpp, world, max_tokens, algorithm):
    """The same RL step from the same weights twice, one actor after the other in the same process
    group: compute_logprobs + train_step(old), then train_step(optimizer_steps_per_rl_step=1)."""
    from rlmega.megatron import offload
    from rlmega.megatron.runtime import teardown_megatron

    batch = random_batch(N, seed=1)
    runs, errors = {}, []
    for kind in ("old", "on_policy"):
        actor = _actor(path, tp, pp, vpp, world, max_tokens, algorithm=algorithm)
        # on the on-policy side too: what train_step must return
        old = actor.compute_logprobs(batch)
        b = dataclasses.replace(batch, ref_logprobs=actor.compute_ref_logprobs(batch))
        # pi_old / pi_rollout from e^-1 to e: some truncated at 2
        if actor.algo.rollout_correction != "none":
            b = dataclasses.replace(
                b, rollout_logprobs=[o - torch.linspace(-1, 1, len(o)) for o in old]
            )
        if kind == "old":
            m = actor.train_step(dataclasses.replace(b, old_logprobs=old))
        else:
            # not stated, or several optimizer steps: old log-probs required
            for steps in (None, 2):
                try:
                    actor.train_step(b, optimizer_steps_per_rl_step=steps)
                except ValueError as e:
                    errors.append(str(e))
            m = actor.train_step(b, optimizer_steps_per_rl_step=1)
        weights = [p.detach().clone() for p in offload.model_params(actor.policy.model)]
        runs[kind] = (m, old, weights)
        teardown_megatron(destroy_process_group=False)  # the next actor joins the same gloo group
    return runs, errors


@pytest.mark.parametrize("name", list(ON_POLICY_CASES))
def test_on_policy_train_step_equals_compute_logprobs_then_train_step(hf_model, name):
    tp, pp, vpp, world, budget, algorithm = ON_POLICY_CASES[name]
    results = run_on_ranks(
        _on_policy_body,
        world,
        args=(hf_model, tp, pp, vpp, world, budget, algorithm),
        timeout_s=300,
    )
    # Measured (float32, CPU, every case here): the no-grad forward of compute_logprobs and the
    # train forward give bit-identical log-probs, hence the same ratio (exactly 1), loss, gradients
    # and updated weights. So the comparisons are exact; a kernel that differs between the two
    # forwards (some GPU ones) would need a tolerance instead.
    for rank, (runs, errors) in enumerate(results):
        (m_old, lp_old, w_old), (m_on, lp_ref, w_on) = runs["old"], runs["on_policy"]
        returned = m_on.pop("old_logprobs")
        assert "old_logprobs" not in m_old
        assert len(returned) == N and all(torch.equal(a, b) for a, b in zip(returned, lp_ref)), (
            f"{name} rank {rank}"
        )
        # both sides started from the same policy
        assert all(torch.equal(a, b) for a, b in zip(lp_old, lp_ref))
        assert m_on.keys() == m_old.keys()
        for key, want in m_old.items():
            got = m_on[key]
            assert got == want or (math.isnan(got) and math.isnan(want)), (
                f"{name} rank {rank} {key}: {got} vs {want}"
            )
        assert m_on["ppo_kl"] == 0.0 and m_on["pg_clipfrac"] == 0.0 and m_on["grad_norm"] > 0
        assert len(w_on) == len(w_old) and all(torch.equal(a, b) for a, b in zip(w_on, w_old)), (
            f"{name} rank {rank}"
        )
        if algorithm.get("rollout_correction") == "tis":
            assert 0 < m_on["rollout_is_truncated"] < 1
        assert len(errors) == 2 and all(
            "optimizer_steps_per_rl_step=" in e and "old_logprobs" in e for e in errors
        )


def _entropy_body(path):
    """The same step from the same weights with entropy_coef 0 (entropy a metric, no graph) and 0.5."""
    from rlmega.megatron.runtime import teardown_megatron

    batch = random_batch(N, seed=1)
    mask = torch.cat(batch.response_mask)
    out = {}
    for coef in (0.0, 0.5):
        actor = _actor(path, max_tokens=16, algorithm={"entropy_coef": coef, "kl_coef": 0.0})
        old, ent = actor.compute_logprobs(batch, with_entropy=True)
        m = actor.train_step(dataclasses.replace(batch, old_logprobs=old))
        out[coef] = (m, float((torch.cat(ent) * mask).sum() / mask.sum()))
        teardown_megatron(destroy_process_group=False)  # the next actor joins the same gloo group
    return out


def test_entropy_is_reported_at_coefficient_zero_and_trained_above_it(hf_model):
    out = run_on_ranks(_entropy_body, 1, args=(hf_model,), timeout_s=300)[0]
    for coef, (m, want) in out.items():  # the metric: the token-mean entropy compute_logprobs gives
        assert abs(m["entropy"] - want) <= 1e-6 * want, (coef, m["entropy"], want)
    (m0, _), (m5, _) = out[0.0], out[0.5]
    assert m0["pg_loss"] == m5["pg_loss"]  # same policy, same batch: only the entropy bonus differs
    # the bonus reaches the gradient
    assert m5["loss"] < m0["loss"] and m5["grad_norm"] != m0["grad_norm"]


def _packing_body(path):
    from rlmega.data.micro_batches import build_micro_batch, scatter_responses
    from rlmega.megatron import pipeline_passes

    actor = _actor(path, max_tokens=60)
    batch = random_batch(N, seed=2)
    packed = actor.compute_logprobs(batch)
    singles = []
    for i in range(N):  # one sequence per row: the unpacked baseline
        mb = build_micro_batch(batch, [i])
        out = pipeline_passes.forward_logprobs(
            actor.policy.model, [mb], actor.vocab_size, actor.temperature
        )
        singles.append(scatter_responses(out[0]["logprobs"], mb)[i])
    mbs, eff = actor._plan(batch)
    lengths = batch.lengths()
    # (real tokens, B, S, longest sample) of each micro-batch as the actor built it
    blocks = [
        (
            sum(lengths[i] for i in mb["indices"]),
            *mb["tokens"].shape,
            max(lengths[i] for i in mb["indices"]),
        )
        for mb in mbs
    ]
    actor.teardown()
    return packed, singles, eff, blocks


def test_packed_logprobs_equal_unpacked_and_transformers(hf_model):
    packed, singles, efficiency, blocks = run_on_ranks(
        _packing_body, 1, args=(hf_model,), timeout_s=300
    )[0]
    # one packed row per micro-batch, several sequences in it, no padding (PackedSDPAttention per sequence)
    assert all(B == 1 and S == real for real, B, S, _ in blocks) and max(
        S for _, _, S, _ in blocks
    ) > 2 * max(longest for *_, longest in blocks), blocks
    assert efficiency == 1.0
    gap = max((p - s).abs().max().item() for p, s in zip(packed, singles))
    # measured 0: per-sequence SDPA is the unpacked arithmetic (GEMM shapes aside)
    assert gap <= 1e-6, gap
    batch = random_batch(N, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    worst = 0.0
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            logits = hf(toks[None]).logits[0] / 0.8
            p = int(batch.prompt_lens[i])
            want = torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, toks[p:, None])[:, 0]
            worst = max(worst, (want - packed[i]).abs().max().item())
    assert worst <= 5e-6, worst  # measured 4.8e-7


def _learning_body(path):
    actor = _actor(path, pp=2, max_tokens=40)
    batch = random_batch(N, seed=0)  # 4 of 5 groups have a nonzero advantage
    weights = torch.tensor([float(a[0]) for a in batch.advantages])

    def objective():  # advantage-weighted mean log-prob of each response
        lp = actor.compute_logprobs(batch)
        return float(sum(w * lp_i.mean() for w, lp_i in zip(weights, lp)))

    before = objective()
    for _ in range(4):
        _rl_step(actor, batch)
    after = objective()
    ref_before = actor.compute_ref_logprobs(batch)
    actor.update_ref_policy(1.0)  # copy: the reference now equals the policy
    ref_after, policy_now = actor.compute_ref_logprobs(batch), actor.compute_logprobs(batch)
    actor.teardown()
    same = all(torch.equal(a, b) for a, b in zip(ref_after, policy_now))
    moved = any(not torch.equal(a, b) for a, b in zip(ref_before, ref_after))
    return before, after, same, moved


def test_rl_steps_raise_the_advantage_weighted_logprob_and_ref_update_copies(hf_model):
    before, after, ref_equals_policy, ref_moved = run_on_ranks(
        _learning_body, 2, args=(hf_model,), timeout_s=300
    )[0]
    assert after > before + 0.1, (before, after)
    assert ref_equals_policy and ref_moved


def _nan_body(path, skip):
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    actor = _actor(path, tp=2, pp=2, skip_nonfinite_steps=skip)
    batch = random_batch(N, seed=4)
    params = [p.detach().clone() for p in actor.policy.model[0].parameters()]
    hook = None
    if ps.get_pipeline_model_parallel_rank() == 0:  # poison one stage's activations only
        layer = actor.policy.unwrapped()[0].decoder.layers[0]
        hook = layer.register_forward_hook(lambda m, i, out: (out[0] * float("nan"), *out[1:]))
    try:
        first, _ = _rl_step(actor, batch)
    except FloatingPointError as e:
        return "raised", str(e)
    finally:
        if hook is not None:
            hook.remove()
    unchanged = all(torch.equal(a, b) for a, b in zip(params, actor.policy.model[0].parameters()))
    second, _ = _rl_step(actor, batch)
    rank = dist.get_rank()
    actor.teardown()
    return first["skipped"], unchanged, second["skipped"], math.isfinite(second["loss"]), rank


def test_nan_on_one_pipeline_stage_skips_the_step_on_every_rank(hf_model):
    results = run_on_ranks(_nan_body, 4, args=(hf_model, True), timeout_s=240)
    for skipped, unchanged, second_skipped, finite, rank in results:
        assert skipped == 1.0 and unchanged, f"rank {rank}"
        assert second_skipped == 0.0 and finite, f"rank {rank}: training did not resume"
    raised = run_on_ranks(_nan_body, 4, args=(hf_model, False), timeout_s=240)
    assert all(r[0] == "raised" and "non-finite" in r[1] for r in raised), raised


def _warm_start_lr_body(path):
    actor = _actor(path)
    batch = random_batch(N, seed=5)
    sft = actor.sft_step(batch, lr=0.05)  # outside the schedule
    steps_after_sft = actor.policy.scheduler.num_steps
    rl, _ = _rl_step(actor, batch)
    actor.teardown()
    return sft["lr"], steps_after_sft, rl["lr"]


def test_warm_start_lr_does_not_touch_the_rl_schedule(hf_model):
    sft_lr, steps_after_sft, rl_lr = run_on_ranks(
        _warm_start_lr_body, 1, args=(hf_model,), timeout_s=300
    )[0]
    assert sft_lr == 0.05 and steps_after_sft == 0
    assert rl_lr == 3e-3  # the scheduled LR is back for the first RL step


# ---- rollout correction and the cost of gathering responses ----------------------------------

from rlmega.data.rollout_batch import RolloutBatch  # noqa: E402


class _CountingBatch(RolloutBatch):
    """A RolloutBatch that counts response_lens() calls (each walks the whole batch)."""

    calls = 0

    def response_lens(self):
        type(self).calls += 1
        return super().response_lens()


# Per-sample ratio pi_old / pi_rollout fabricated by rollout = old - log(factor); "mixed" alternates
# 3 and 1/3 over the sample's tokens (geometric mean 1 or 3^(1/3) <= 1.45: inside [.5, 2]).
RC_FACTORS = [3.0, 1.0, 0.25, 1.0, "mixed", 1.0, 3.0, 1.0, 1.0, 0.4]


def _token_ratios(batch):
    out = []
    for i, m in enumerate(batch.response_mask):
        f = RC_FACTORS[i]
        out.append(
            torch.tensor([3.0 if k % 2 == 0 else 1 / 3 for k in range(len(m))])
            if f == "mixed"
            else torch.full((len(m),), f)
        )
    return out


def _rollout_correction_body(path):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.actor import MegatronActor

    # lr 0: the policy stays put, so every call below scores the same parameters with ratio pi/pi_old = 1
    actor = MegatronActor(
        ModelConfig(path=path),
        ParallelismConfig(1, 1, None, 1),
        OptimizerConfig(lr=0.0),
        ActorConfig(max_tokens_per_micro_batch=40),
        AlgorithmConfig(),
        temperature=0.8,
    )
    actor.setup(with_reference=False)
    base = random_batch(N, seed=7)  # 4 of 5 groups carry a nonzero advantage
    counting = _CountingBatch(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(RolloutBatch)}
    )
    _CountingBatch.calls = 0
    old = actor.compute_logprobs(counting)
    lens_calls = _CountingBatch.calls
    rollout = [o - r.log() for o, r in zip(old, _token_ratios(base))]
    plain = dataclasses.replace(base, old_logprobs=old)
    with_rollout = dataclasses.replace(plain, rollout_logprobs=rollout)
    results = {"absent": actor.train_step(plain)}
    for mode in ("none", "tis", "mis_token", "mis_seq"):
        actor.algo = dataclasses.replace(actor.algo, rollout_correction=mode)
        results[mode] = actor.train_step(with_rollout)
    try:
        actor.train_step(plain)  # mis_seq is still set, and this batch has no rollout log-probs
        error = None
    except ValueError as e:
        error = str(e)
    actor.teardown()
    return results, lens_calls, error


def test_rollout_correction_truncates_and_masks_as_fabricated(hf_model):
    results, lens_calls, error = run_on_ranks(
        _rollout_correction_body, 1, args=(hf_model,), timeout_s=300
    )[0]
    # response_lens() walks the batch: once per gather, not once per sample (it was N = 10 calls)
    assert lens_calls == 1, lens_calls
    assert (
        error is not None
        and "algorithm.rollout_correction=mis_seq" in error
        and "rollout_logprobs" in error
    )
    # "none" ignores the rollout log-probs: bit-identical to a batch without them
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "tokens"):
        assert results["none"][key] == results["absent"][key], key
    assert math.isnan(results["absent"]["rollout_is_ratio"])

    batch = random_batch(N, seed=7)
    mask = torch.cat(batch.response_mask).double()
    adv = torch.cat(batch.advantages).double()
    ratio = torch.cat(_token_ratios(batch)).double()
    seq_ratio = torch.cat(
        [
            torch.full((len(r),), float(torch.exp((r.log() * m).sum() / m.sum())))
            for r, m in zip(_token_ratios(batch), batch.response_mask)
        ]
    ).double()
    n_tok = mask.sum()
    # float32 log-probs make exp(old - rollout) 3 +- a few ulp: 1e-6 is what that allows
    for mode in ("none", "tis", "mis_token", "mis_seq"):
        assert (
            abs(results[mode]["rollout_is_ratio"] - float((ratio * mask).sum() / n_tok)) < 1e-6
        ), mode
        # the policy did not move: pi / pi_old = 1 on every token
        assert results[mode]["ppo_kl"] == 0.0

    # TIS: every token's loss -A (ratio 1) is weighted by min(ratio, 2); the denominator is unchanged
    r = results["tis"]
    assert r["rollout_is_truncated"] == float(((ratio > 2) * mask).sum() / n_tok) > 0
    assert r["rollout_is_masked"] == 0.0
    assert abs(r["pg_loss"] - float(-(adv * ratio.clamp(max=2) * mask).sum() / n_tok)) < 1e-6
    # MIS: dropped tokens leave the numerator and the denominator
    in_bounds = {
        "mis_token": (ratio >= 0.5) & (ratio <= 2),
        "mis_seq": (seq_ratio >= 0.5) & (seq_ratio <= 2),
    }
    for mode, keep in in_bounds.items():
        r, kept = results[mode], keep.double() * mask
        assert r["rollout_is_masked"] == float((mask - kept).sum() / n_tok) > 0, mode
        assert r["rollout_is_truncated"] == 0.0
        assert abs(r["pg_loss"] - float(-(adv * kept).sum() / kept.sum())) < 1e-6, mode
        assert abs(r["loss"] - r["pg_loss"]) < 1e-7  # no KL or entropy term here
    # "mixed" sample
    assert results["mis_token"]["rollout_is_masked"] > results["mis_seq"]["rollout_is_masked"]
    assert (
        len({round(results[m]["pg_loss"], 9) for m in ("none", "tis", "mis_token", "mis_seq")}) == 4
    )


# ---- a batch shorter than the data-parallel group (stale drops, short dynamic sampling) ----------

# (tp, pp, vpp, world): DP 2 each
SHORT_CASES = {"dp2": (1, 1, None, 2), "pp2_vpp2_dp2": (1, 2, 2, 4)}


def _short_batch_body(path, tp, pp, vpp, world):
    """One sample, advantage +1: ranks without a sample run placeholder micro-batches (zero loss)."""
    from rlmega.megatron import offload

    actor = _actor(path, tp, pp, vpp, world, max_tokens=24)
    one = random_batch(2, seed=1).select([0])
    one = dataclasses.replace(one, advantages=[torch.ones_like(a) for a in one.advantages])
    before = actor.compute_logprobs(one)
    m = actor.train_step(
        dataclasses.replace(one, ref_logprobs=actor.compute_ref_logprobs(one)),
        optimizer_steps_per_rl_step=1,
    )
    old = m.pop("old_logprobs")
    after = actor.compute_logprobs(one)
    weights = [p.detach().clone() for p in offload.model_params(actor.policy.model)]
    # what rlmega.step does when a short batch took fewer optimizer steps
    actor.advance_lr_schedule(2)
    m["schedule_steps"] = actor.policy.scheduler.num_steps
    actor.teardown()
    return m, before, old, after, weights


@pytest.mark.parametrize("name", list(SHORT_CASES))
def test_a_batch_shorter_than_the_data_parallel_group_trains_as_on_one_rank(hf_model, name):
    tp, pp, vpp, world = SHORT_CASES[name]
    m1, before1, old1, after1, w1 = run_on_ranks(
        _short_batch_body, 1, args=(hf_model, 1, 1, None, 1), timeout_s=300
    )[0]
    results = run_on_ranks(
        _short_batch_body, world, args=(hf_model, tp, pp, vpp, world), timeout_s=300
    )
    assert m1["tokens"] > 0 and m1["grad_norm"] > 0
    assert m1["schedule_steps"] == 3  # one optimizer step taken, two moved on
    assert (after1[0] - before1[0]).abs().max() > 1e-3  # the step moved the policy
    for rank, (m, before, old, after, _) in enumerate(results):
        _assert_same_run([m], [m1], f"{name} rank {rank}")
        for got, want in ((before, before1), (old, old1), (after, after1)):
            assert len(got) == 1 and (got[0] - want[0]).abs().max() <= 1e-5, f"{name} rank {rank}"
    if pp == 1:  # the two DP replicas hold the same weights, those of the single process
        for _, _, _, _, w in results:
            assert max((a - b).abs().max().item() for a, b in zip(w, w1)) <= 1e-6
