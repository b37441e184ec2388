"""rlmega.algorithms: every function against values worked out by hand (arithmetic in the comments),
plus the properties the trainer relies on (clipping cuts gradients, aggregation is split-invariant)."""

import math

import pytest
import torch

from rlmega.algorithms import advantages, kl, losses, rollout_correction

F64 = torch.float64


def t(*values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def close(actual, expected, atol=1e-6):
    expected = expected if torch.is_tensor(expected) else torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- advantages

# Shared example: rewards [1,0,0,2,5] in groups [7,7,7,3,9] (ids need not be contiguous).
# Group 7 = {1,0,0}: mean 1/3, deviations [2/3,-1/3,-1/3], squared sum 4/9+1/9+1/9 = 2/3,
# unbiased var = (2/3)/(3-1) = 1/3, std = 0.5773503. Groups 3 and 9 are singletons.
REWARDS = t(1.0, 0.0, 0.0, 2.0, 5.0)
GROUPS = ids(7, 7, 7, 3, 9)


def test_grpo_hand_values_unbiased_std_and_singletons_zero():
    # (2/3)/0.5773503 = 1.1547005, (-1/3)/0.5773503 = -0.5773503; singletons -> 0.
    s = math.sqrt(1 / 3) + 1e-6
    close(advantages.grpo(REWARDS, GROUPS), [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0])


def test_grpo_two_groups_and_unanimous_group():
    # rewards [1,0,1,1], groups [0,0,1,1]: group 0 mean .5, unbiased std sqrt((.25+.25)/1) = .7071068
    # -> +-.5/(.7071068 + eps) ~ +-.7071058; group 1 all equal -> 0/(0+eps) = 0.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(advantages.grpo(t(1, 0, 1, 1), ids(0, 0, 1, 1)), [a, -a, 0.0, 0.0])


def test_grpo_no_std_hand_values():
    # r - group mean: [1-1/3, 0-1/3, 0-1/3, 2-2, 5-5]
    close(advantages.grpo(REWARDS, GROUPS, norm_by_std=False), [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])


def test_rloo_hand_values():
    # group 7: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice); singletons -> 0.
    close(advantages.rloo(REWARDS, GROUPS), [1.0, -0.5, -0.5, 0.0, 0.0])


def test_integer_rewards_are_promoted():
    # 0/1 correctness as int64: group mean 0.5 must not round to 0.
    close(advantages.rloo(torch.tensor([1, 0]), ids(0, 0)), t(1.0, -1.0, dtype=torch.float32))


def test_reinforce_plus_plus_hand_values():
    # rewards [1,0,1,1], groups [0,0,1,1]: minus group mean -> [.5,-.5,0,0]; batch mean 0;
    # population std sqrt((.25+.25+0+0)/4) = .3535534 -> [1.4142136, -1.4142136, 0, 0].
    s = math.sqrt(0.125) + 1e-6
    close(
        advantages.reinforce_plus_plus(t(1, 0, 1, 1), ids(0, 0, 1, 1)),
        [0.5 / s, -0.5 / s, 0.0, 0.0],
    )


def test_reinforce_plus_plus_is_whitened_over_the_batch():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, generator=g, dtype=F64) * 10
    adv = advantages.reinforce_plus_plus(rewards, torch.arange(64) // 8)
    close(adv.mean(), 0.0)
    close(adv.std(unbiased=False), 1.0, atol=1e-5)


def test_singleton_groups_give_zero_for_every_estimator():
    rewards, groups = t(3.0, -1.0, 7.0), ids(0, 1, 2)
    for name in advantages.ESTIMATORS:
        close(advantages.compute(name, rewards, groups), [0.0, 0.0, 0.0])


def _mixed_groups(seed, dtype=torch.float32):
    """Many unanimous groups of non-representable rewards (0.1, 0.7, 1.1, 1/3, ...) and sizes 2..64,
    interleaved with ordinary groups, ids shuffled. Returns rewards (N,), group ids (N,), unanimous (N,) bool."""
    g = torch.Generator().manual_seed(seed)
    values = [0.1, 0.7, 1.1, 1 / 3, 2 / 3, 0.3, -0.9, 7.7, 1e3 / 3]
    rewards, groups, unanimous = [], [], []
    for gid in range(120):
        size = int(torch.randint(2, 65, (1,), generator=g))
        if gid % 3:  # two thirds unanimous
            r = torch.full(
                (size,), values[int(torch.randint(len(values), (1,), generator=g))], dtype=F64
            )
        else:
            r = torch.rand(size, generator=g, dtype=F64) * 3
        rewards.append(r)
        groups.append(torch.full((size,), gid, dtype=torch.int64))
        unanimous.append(torch.full((size,), bool(gid % 3)))
    perm = torch.randperm(sum(len(r) for r in rewards), generator=g)
    return torch.cat(rewards).to(dtype)[perm], torch.cat(groups)[perm], torch.cat(unanimous)[perm]


@pytest.mark.parametrize("name", advantages.ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_unanimous_groups_get_exactly_zero_and_others_match_float64(name, dtype):
    # Before the fix, float32 grpo gave unanimous groups of 0.1/0.7/1.1 advantages up to ~0.6, all of one
    # sign: the mean is one rounding step off and (r - mean) / (std ~1e-7 + 1e-6) blows it up.
    for seed in range(3):
        rewards, groups, unanimous = _mixed_groups(seed, dtype)
        adv = advantages.compute(name, rewards, groups)
        assert adv.dtype == dtype
        assert torch.equal(adv[unanimous], torch.zeros_like(adv[unanimous])), (
            adv[unanimous].abs().max()
        )
        # the same rewards (as given, converted exactly) through float64 arithmetic, rounded once at the end
        want = advantages.compute(name, rewards.double(), groups).to(dtype)
        assert torch.equal(adv, want)
        assert adv[~unanimous].abs().min() > 0


def test_reinforce_plus_plus_float64_reference_by_hand():
    # every group unanimous except one {0.1, 0.7}: minus group mean [-.3, .3], others 0 (exactly);
    # population std over N=6: sqrt(2 * .09 / 6) = sqrt(.03) -> +-.3 / (sqrt(.03) + 1e-6) = +-1.7320408
    rewards = t(0.1, 0.7, 0.1, 0.1, 1 / 3, 1 / 3, dtype=torch.float32)
    adv = advantages.reinforce_plus_plus(rewards, ids(0, 0, 1, 1, 2, 2))
    d = float(torch.tensor(0.7, dtype=torch.float32)) - float(
        torch.tensor(0.1, dtype=torch.float32)
    )
    s = math.sqrt(2 * (d / 2) ** 2 / 6) + 1e-6
    assert torch.equal(adv[2:], torch.zeros(4))
    close(adv[:2], [-d / 2 / s, d / 2 / s], atol=1e-7)


def test_compute_dispatches_and_rejects_unknown():
    close(advantages.compute("grpo", REWARDS, GROUPS), advantages.grpo(REWARDS, GROUPS))
    close(
        advantages.compute("grpo_no_std", REWARDS, GROUPS),
        advantages.grpo(REWARDS, GROUPS, norm_by_std=False),
    )
    close(advantages.compute("rloo", REWARDS, GROUPS), advantages.rloo(REWARDS, GROUPS))
    close(
        advantages.compute("reinforce_plus_plus", REWARDS, GROUPS),
        advantages.reinforce_plus_plus(REWARDS, GROUPS),
    )
    with pytest.raises(ValueError, match="grpo_no_std.*rloo.*reinforce_plus_plus"):
        advantages.compute("ppo", REWARDS, GROUPS)


def test_to_tokens_broadcasts_and_zeroes_masked_tokens():
    # seq 0 -> 2, seq 1 -> -1; token 4 is masked and carries an out-of-range id (5): must be 0, not an error.
    out = advantages.to_tokens(t(2.0, -1.0), ids(0, 0, 1, 1, 5, 0), t(0, 1, 1, 1, 0, 1))
    close(out, [0.0, 2.0, -1.0, -1.0, 0.0, 2.0])


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    # logp [-1,-2], ref [-2,-1]: ref - logp = [-1, 1].
    # k1 = logp - ref = [1,-1]; k2 = .5*[1,1]; k3 = [e^-1 + 1 - 1, e^1 - 1 - 1] = [.3678794, .7182818].
    logp, ref = t(-1.0, -2.0), t(-2.0, -1.0)
    close(kl.kl_penalty(logp, ref, "k1"), [1.0, -1.0])
    close(kl.kl_penalty(logp, ref, "k2"), [0.5, 0.5])
    close(kl.kl_penalty(logp, ref, "k3"), [math.exp(-1), math.e - 2])


def test_kl_is_exactly_zero_when_policies_agree():
    logp = torch.randn(16, dtype=torch.float32)
    for name in kl.ESTIMATORS:
        assert torch.equal(kl.kl_penalty(logp, logp.clone(), name), torch.zeros(16)), name


def test_k3_nonnegative_and_finite_on_random_and_extreme_inputs():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(4096, generator=g) * 30, torch.randn(4096, generator=g) * 30
    k3 = kl.kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    # clamp: ref - logp = -100 -> -20: e^-20 + 20 - 1; +100 -> +20: e^20 - 21.
    close(
        kl.kl_penalty(t(0.0, -100.0), t(-100.0, 0.0), "k3"), [math.exp(-20) + 19, math.exp(20) - 21]
    )


@pytest.mark.parametrize("seed", range(3))
def test_kl_estimator_expected_gradients_exactly(seed):
    # A categorical policy pi = softmax(theta) over 7 tokens and a fixed reference. The expected loss
    # of a per-token estimator k under on-policy sampling is sum_y sg(pi(y)) * k(y): the sampling
    # distribution is not differentiated (the tokens are given), only logp inside k is. Its exact
    # gradient (no sampling) must be 0 for k1, grad KL(pi||ref) for k2, grad KL(ref||pi) for k3.
    g = torch.Generator().manual_seed(seed)
    theta0, ref_logits = (
        torch.randn(7, generator=g, dtype=F64),
        2 * torch.randn(7, generator=g, dtype=F64),
    )
    ref_logp = torch.log_softmax(ref_logits, -1)

    def grad_of(fn):
        theta = theta0.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, -1)
        (grad,) = torch.autograd.grad(fn(logp), theta)
        return grad

    def expected(estimator):
        return lambda logp: (logp.exp().detach() * kl.kl_penalty(logp, ref_logp, estimator)).sum()

    reverse = grad_of(lambda logp: (logp.exp() * (logp - ref_logp)).sum())  # grad KL(pi||ref)
    forward = grad_of(lambda logp: (ref_logp.exp() * (ref_logp - logp)).sum())  # grad KL(ref||pi)
    # the claims can fail
    assert reverse.abs().max() > 0.05 and (reverse - forward).abs().max() > 0.05
    close(grad_of(expected("k1")), torch.zeros(7), atol=1e-15)
    close(grad_of(expected("k2")), reverse, atol=1e-14)
    close(grad_of(expected("k3")), forward, atol=1e-14)
    # and the values: k1 and k3 are unbiased for KL(pi||ref), k2 is not
    pi = torch.softmax(theta0, -1)
    kl_rev = float((pi * (pi.log() - ref_logp)).sum())
    for est in ("k1", "k3"):
        close((pi * kl.kl_penalty(pi.log(), ref_logp, est)).sum(), kl_rev, atol=1e-14)


def test_kl_in_reward_counts_only_the_tokens_the_loss_trains_on():
    """algorithm.kl_in_reward's per-sequence penalty over a tool loop's batch: tool output (mask 0 inside
    the response) and a response overlong=mask took out add nothing (rlmega.step, issue 22 item 14)."""
    import dataclasses

    from rlmega.agents.trajectory import Trajectory, TrajectoryGroup, batch_from_groups
    from rlmega.config.schema import AlgorithmConfig, RLConfig
    from rlmega.step import shape_overlong

    tool = Trajectory(prompt_ids=[1, 2], finish_reason="stop")
    tool.append([3, 4], [-1.0, -2.0], 0, model=True)  # a tool call: sampled
    tool.append([5, 6, 7], None, 0, model=False)  # the tool's result: not sampled
    tool.append([8], [-0.5], 0, model=True)  # the answer: sampled
    # hit the budget: overlong=mask drops it
    cut = Trajectory(prompt_ids=[1], finish_reason="length")
    cut.append([3, 4], [-1.0, -1.0], 0, model=True)
    groups = [TrajectoryGroup("t", 0, "x", [tool, cut])]
    cfg = dataclasses.replace(RLConfig(), algorithm=AlgorithmConfig(overlong="mask"))
    batch, _ = shape_overlong(batch_from_groups(groups), [("t", x) for x in (tool, cut)], cfg)
    assert [m.tolist() for m in batch.response_mask] == [[1, 1, 0, 0, 0, 1], [0, 0]]
    # the trainer's old log-probs score the tool tokens too (they are in the sequence); the reference
    # disagrees with them wildly there (a NaN as well), which must not matter
    old = [t(-1.0, -2.0, -9.0, -9.0, -9.0, -0.5), t(-1.0, -1.0)]
    ref = [t(-2.0, -1.0, 0.0, float("nan"), -1.0, -0.5), t(-3.0, -3.0)]
    # sample 0, k1 = logp - ref on tokens 0, 1, 5: 1 - 1 + 0 = 0; k3: (e^-1 - 0) + (e - 2) + 0
    close(kl.sequence_kl(old, ref, batch.response_mask, "k1"), [0.0, 0.0])
    close(kl.sequence_kl(old, ref, batch.response_mask, "k3"), [math.exp(-1) + math.e - 2, 0.0])
    # what the step summed before: every response token, tool output and dropped responses included
    unmasked = [float(kl.kl_penalty(o, r, "k1").sum()) for o, r in zip(old, ref)]
    assert not all(math.isfinite(u) and abs(u) < 1e-9 for u in unmasked)
    assert kl.sequence_kl([], [], [], "k3").shape == (0,)


def test_kl_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl.kl_penalty(t(0.0), t(0.0), "k4")


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_hand_values_and_gradient_cut_exactly_where_clipped():
    # old = 0 so ratio = exp(logp). eps 0.2 -> clip range [0.8, 1.2].
    # t0 r=1.5 A=+1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped (grad 0)
    # t1 r=1.5 A=-1: min(-1.5, -1.2) = -1.5 -> loss 1.5, unclipped, dloss/dlogp = -r*A = 1.5
    # t2 r=0.5 A=+1: min(0.5, 0.8) = 0.5 -> loss -0.5, unclipped, grad -0.5
    # t3 r=0.5 A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped (grad 0)
    # t4 r=1.1 A=+2: inside the range -> loss -2.2, grad -2.2
    # t5 masked (old is NaN garbage) -> loss 0, grad 0
    ratio = t(1.5, 1.5, 0.5, 0.5, 1.1, 1.0)
    logp = ratio.log().requires_grad_()
    old, adv, mask = t(0, 0, 0, 0, 0, float("nan")), t(1, -1, 1, -1, 2, 1), t(1, 1, 1, 1, 1, 0)
    loss, stats = losses.ppo_clip(logp, old, adv, mask)
    close(loss, [-1.2, 1.5, -0.5, 0.8, -2.2, 0.0])
    close(stats["clipped"], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    close(stats["ratio"], [1.5, 1.5, 0.5, 0.5, 1.1, 0.0])
    close(stats["ppo_kl"], -ratio.log() * mask)  # old - logp
    loss.sum().backward()
    close(logp.grad, [0.0, 1.5, -0.5, 0.0, -2.2, 0.0])


def test_ppo_clip_gradient_zero_iff_clipped_on_random_tokens():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(256, generator=g, dtype=F64) * 5
    logp = (old + torch.randn(256, generator=g, dtype=F64) * 0.3).requires_grad_()
    adv = torch.randn(256, generator=g, dtype=F64)  # nonzero almost surely
    loss, stats = losses.ppo_clip(
        logp, old, adv, torch.ones(256, dtype=F64), clip_low=0.2, clip_high=0.28
    )
    loss.sum().backward()
    clipped = stats["clipped"].bool()
    assert 0 < clipped.sum() < 256  # both branches exercised
    assert (logp.grad[clipped] == 0).all() and (logp.grad[~clipped] != 0).all()


def test_ppo_clip_at_ratio_one_is_minus_advantage():
    logp = torch.randn(8, dtype=F64)
    adv = torch.randn(8, dtype=F64)
    loss, stats = losses.ppo_clip(logp, logp.clone(), adv, torch.ones(8, dtype=F64))
    close(loss, -adv)
    assert torch.equal(stats["ppo_kl"], torch.zeros(8, dtype=F64))
    close(stats["ratio"], torch.ones(8))
    close(stats["clipped"], torch.zeros(8))


def test_ppo_clip_higher_is_asymmetric():
    # clip_low .2, clip_high .28: r=1.25 A=+1 stays unclipped (-1.25; symmetric clip would give -1.2);
    # r=.75 A=-1: min(-.75, -.8) = -.8 -> loss .8, clipped at the low side.
    loss, stats = losses.ppo_clip(
        t(1.25, 0.75).log(), t(0.0, 0.0), t(1.0, -1.0), t(1.0, 1.0), clip_low=0.2, clip_high=0.28
    )
    close(loss, [-1.25, 0.8])
    close(stats["clipped"], [0.0, 1.0])


def test_dual_clip_caps_loss_for_large_ratio_and_negative_advantage():
    # c = 3. t0 r=10 A=-1: plain loss -min(-10, -1.2) = 10 -> capped at -c*A = 3 (clipped, grad 0).
    # t1 r=2 A=-1: loss 2 < 3, uncapped, grad -r*A = 2. t2 r=10 A=+1: dual clip ignores A>0 -> -1.2, clipped.
    # t3 log-ratio 50 (clamped to 20) A=-.5: cap -3*-.5 = 1.5.
    logp = torch.cat([t(10.0, 2.0, 10.0).log(), t(50.0)]).requires_grad_()
    adv = t(-1.0, -1.0, 1.0, -0.5)
    loss, stats = losses.ppo_clip(
        logp, torch.zeros(4, dtype=F64), adv, torch.ones(4, dtype=F64), dual_clip_c=3.0
    )
    close(loss, [3.0, 2.0, -1.2, 1.5])
    close(stats["clipped"], [1.0, 0.0, 1.0, 1.0])
    loss.sum().backward()
    close(logp.grad, [0.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="dual_clip_c"):
        losses.ppo_clip(logp, logp, adv, adv, dual_clip_c=1.0)


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_values():
    # seq 0: token log-ratios [.1, .3] -> mean .2 -> s0 = e^.2 = 1.2214028 > 1.2; A=+1 -> clipped, loss -1.2.
    # seq 1: [-.2, 0, -.1] -> mean -.1 -> s1 = e^-.1 = .9048374 inside [.8,1.2]; A=-2 -> loss 1.8096748,
    #        grad per token -s1*A = 1.8096748. Token 2 is masked with a garbage id 9: must not enter any mean.
    logp = t(0.1, 0.3, 5.0, -0.2, 0.0, -0.1).requires_grad_()
    old = torch.zeros(6, dtype=F64)
    adv, mask, seq = t(1, 1, 1, -2, -2, -2), t(1, 1, 0, 1, 1, 1), ids(0, 0, 9, 1, 1, 1)
    loss, stats = losses.gspo(logp, old, adv, mask, seq, 2, clip_low=0.2, clip_high=0.2)
    s1 = math.exp(-0.1)
    close(loss, [-1.2, -1.2, 0.0, 2 * s1, 2 * s1, 2 * s1])
    close(stats["ratio"], [math.exp(0.2), math.exp(0.2), 0.0, s1, s1, s1])
    close(stats["clipped"], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    close(stats["ppo_kl"], [-0.1, -0.3, 0.0, 0.2, 0.0, 0.1])
    loss.sum().backward()
    close(logp.grad, [0.0, 0.0, 0.0, 2 * s1, 2 * s1, 2 * s1])


def test_gspo_equals_ppo_when_token_ratios_agree_within_each_sequence():
    # Three sequences with constant log-ratios .3 (clipped for A>0), -.05 (inside), -.4 (clipped for A<0).
    seq = ids(0, 0, 0, 1, 1, 2, 2, 2, 2)
    per_seq = t(0.3, -0.05, -0.4)
    old = -torch.rand(9, generator=torch.Generator().manual_seed(3), dtype=F64)
    adv = t(1, 1, 1, -1, 2, -1, -1, -1, -1)
    mask = torch.ones(9, dtype=F64)
    lp_g = (old + per_seq[seq]).requires_grad_()
    lp_p = lp_g.detach().clone().requires_grad_()
    loss_g, st_g = losses.gspo(lp_g, old, adv, mask, seq, 3, clip_low=0.2, clip_high=0.2)
    loss_p, st_p = losses.ppo_clip(lp_p, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(loss_g, loss_p, atol=1e-12)
    for key in ("clipped", "ratio", "ppo_kl"):
        close(st_g[key], st_p[key], atol=1e-12)
    loss_g.sum().backward()
    loss_p.sum().backward()
    close(lp_g.grad, lp_p.grad, atol=1e-12)
    assert 0 < st_g["clipped"].sum() < 9


# ---------------------------------------------------------------- entropy, masked_mean


def test_entropy_bonus_hand_values():
    # -0.01 * [1,2,3] * [1,0,1] = [-.01, 0, -.03]
    close(losses.entropy_bonus(t(1.0, 2.0, 3.0), t(1.0, 0.0, 1.0), 0.01), [-0.01, 0.0, -0.03])


def test_masked_mean_hand_values():
    # (1 + 3) / 2 = 2; NaN on a masked token is ignored; empty mask -> 0.
    close(losses.masked_mean(t(1.0, float("nan"), 3.0, 4.0), t(1.0, 0.0, 1.0, 0.0)), 2.0)
    close(losses.masked_mean(t(1.0, 2.0), t(0.0, 0.0)), 0.0)


# ---------------------------------------------------------------- aggregate

# l = [1,2,3,4,5,6], mask [1,1,0,1,1,1], seq [0,0,0,1,2,2], 4 sequences (seq 3 has no token).
AGG = (t(1, 2, 3, 4, 5, 6), t(1, 1, 0, 1, 1, 1), ids(0, 0, 0, 1, 2, 2), 4)


@pytest.mark.parametrize(
    "mode,numerator,denominator",
    [
        ("token-mean", 1 + 2 + 4 + 5 + 6, 5.0),  # 18 / 5 masked tokens
        (
            "seq-mean-token-sum",
            (1 + 2) + 4 + (5 + 6),
            3.0,
        ),  # 3 + 4 + 11 = 18 over 3 present sequences
        ("seq-mean-token-mean", 3 / 2 + 4 / 1 + 11 / 2, 3.0),  # 1.5 + 4 + 5.5 = 11 over 3
    ],
)
def test_aggregate_hand_values(mode, numerator, denominator):
    num, den = losses.aggregate(*AGG, mode)
    close(num, numerator)
    # a tensor: no host sync
    assert torch.is_tensor(den) and den.dim() == 0 and float(den) == denominator


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        losses.aggregate(*AGG, "sum")


def _packed(lengths, prompt_len, values):
    """Pack sequences of the given response lengths, each after `prompt_len` masked prompt tokens."""
    mask, seq = [], []
    for i, n in enumerate(lengths):
        mask += [0.0] * prompt_len + [1.0] * n
        seq += [i] * (prompt_len + n)
    return values[: len(mask)], torch.tensor(mask, dtype=F64), torch.tensor(seq)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregate_split_into_micro_batches_matches_one_batch(mode):
    lengths = [1, 7, 3, 12, 2, 5]
    values = torch.randn(200, generator=torch.Generator().manual_seed(4), dtype=F64)
    l_all, m_all, s_all = _packed(lengths, 2, values)
    num, den = losses.aggregate(l_all, m_all, s_all, len(lengths), mode)
    # Reference straight from the definitions over the global batch.
    seqs = [l_all[(s_all == i) & (m_all > 0)] for i in range(len(lengths))]
    expected = {
        "token-mean": torch.cat(seqs).mean(),
        "seq-mean-token-sum": torch.stack([x.sum() for x in seqs]).mean(),
        "seq-mean-token-mean": torch.stack([x.mean() for x in seqs]).mean(),
    }[mode]
    close(num / den, expected, atol=1e-12)
    # Two micro-batches of unequal size (sequences 0-1 and 2-5), seq ids renumbered per micro-batch.
    cut = 2 * 2 + 1 + 7
    parts = [
        losses.aggregate(l_all[:cut], m_all[:cut], s_all[:cut], 2, mode),
        losses.aggregate(l_all[cut:], m_all[cut:], s_all[cut:] - 2, 4, mode),
    ]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    close(total, expected, atol=1e-12)
    # The naive mean of per-micro-batch means differs: the pair is what makes the split irrelevant.
    naive = sum(p[0] / p[1] for p in parts) / 2
    assert abs(float(naive - expected)) > 1e-3


# ---------------------------------------------------------------- rollout correction

# Log-ratios old - rollout chosen so each ratio is a round number: ln 3 -> 3, -ln 4 -> 0.25.
LN = math.log


def test_tis_weights_are_the_ratio_capped_at_c():
    # ratios [1, 3, .25, 1.5, (masked)], cap 2 -> weights [1, 2, .25, 1.5, 0]; only the 3 is truncated.
    # The masked token has rollout -inf (e.g. an engine that did not score it): it must stay 0, not NaN.
    old = t(0.0, LN(3), -LN(4), LN(1.5), 5.0)
    rollout = t(0.0, 0.0, 0.0, 0.0, -math.inf)
    mask = t(1, 1, 1, 1, 0)
    w, st = rollout_correction.tis(old, rollout, mask, cap=2.0)
    close(w, [1.0, 2.0, 0.25, 1.5, 0.0], atol=1e-12)
    close(st["ratio"], [1.0, 3.0, 0.25, 1.5, 0.0], atol=1e-12)
    close(st["truncated"], [0, 1, 0, 0, 0])
    close(st["masked"], [0, 0, 0, 0, 0])


def test_tis_weight_is_detached():
    old = t(LN(3), LN(1.5)).requires_grad_(True)
    w, _ = rollout_correction.tis(old, t(0.0, 0.0), t(1, 1), cap=2.0)
    assert not w.requires_grad


def test_mis_token_drops_tokens_outside_bounds():
    # ratios [1, 3, .25, 1.5, .6]; bounds [.5, 2] keep [1, 0, 0, 1, 1]; the last token is off the mask.
    old = t(0.0, LN(3), -LN(4), LN(1.5), LN(0.6))
    mask = t(1, 1, 1, 1, 0)
    keep, st = rollout_correction.mis_token(old, torch.zeros(5, dtype=F64), mask, low=0.5, high=2.0)
    close(keep, [1, 0, 0, 1, 0])
    close(st["masked"], [0, 1, 1, 0, 0])
    close(st["truncated"], [0, 0, 0, 0, 0])


def test_mis_seq_uses_the_geometric_mean_over_masked_tokens():
    # seq 0: token ratios 3 and 1/3 -> geometric mean 1 -> kept (token-level MIS would drop both);
    # seq 1: ratios 2 and 4 -> sqrt(8) = 2.83 > 2 -> dropped whole;
    # seq 2: one ratio .6 plus an off-mask token with ratio e^20 and an out-of-range id -> .6, kept.
    old = t(LN(3), -LN(3), LN(2), LN(4), LN(0.6), 30.0)
    seq_ids = ids(0, 0, 1, 1, 2, 99)
    mask = t(1, 1, 1, 1, 1, 0)
    zero = torch.zeros(6, dtype=F64)
    close(
        rollout_correction.sequence_log_ratio(old, zero, mask, seq_ids, 3),
        [0.0, LN(math.sqrt(8)), LN(0.6)],
        atol=1e-12,
    )
    keep, st = rollout_correction.mis_seq(old, zero, mask, seq_ids, 3, low=0.5, high=2.0)
    close(keep, [1, 1, 0, 0, 1, 0])
    close(st["masked"], [0, 0, 1, 1, 0, 0])
    # token ratios, for the mean-ratio metric
    close(st["ratio"], [3.0, 1 / 3, 2.0, 4.0, 0.6, 0.0], atol=1e-12)
    keep, _ = rollout_correction.mis_seq(old, zero, mask, seq_ids, 3, low=0.5, high=3.0)
    close(keep, [1, 1, 1, 1, 1, 0])


def test_rollout_correction_dispatch():
    old, ro, mask = t(LN(3), 0.0), t(0.0, 0.0), t(1, 1)
    w, keep, st = rollout_correction.correct("tis", old, ro, mask, ids(0, 1), 2, cap=2.0)
    close(w, [2.0, 1.0], atol=1e-12)
    close(keep, [1, 1])
    w, keep, st = rollout_correction.correct("mis_token", old, ro, mask, ids(0, 1), 2)
    close(w, [1, 1])
    close(keep, [0, 1])
    w, keep, st = rollout_correction.correct("mis_seq", old, ro, mask, ids(0, 0), 1)
    close(keep, [1, 1])  # geometric mean sqrt(3) = 1.73 is inside [.5, 2]
    w, keep, st = rollout_correction.correct("none", old, ro, mask, ids(0, 1), 2)
    close(w, [1, 1])
    close(keep, [1, 1])
    close(st["ratio"], [3.0, 1.0], atol=1e-12)
    with pytest.raises(ValueError, match="tis.*mis_token.*mis_seq"):
        rollout_correction.correct("is", old, ro, mask, ids(0, 1), 2)
