"""rlmega.algorithms.gae: a plain-float loop as the reference (bit-exact in float64), hand-worked
multi-turn examples (arithmetic in the comments, all values exact in binary), and the limit cases
lam = 0 (one-step TD) and gamma = lam = 1 (Monte-Carlo reward-to-go)."""

import math

import pytest
import torch

from rlmega.algorithms import gae as G

F64 = torch.float64


def t(*values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def reference_row(r, v, m, gamma, lam):
    """One row in plain Python floats, as the module docstring states it: fold each masked token's
    reward onto the previous action token (walking backwards), then the GAE recursion over the action
    tokens alone, V and A = 0 past the last one. Returns (advantages, returns) lists, 0 on masked."""
    length = len(r)
    folded, pending = {}, 0.0
    for i in reversed(range(length)):
        if m[i] > 0:
            folded[i], pending = r[i] + pending, 0.0
        else:
            pending = r[i] + pending  # dropped if no action token comes before it
    actions = sorted(folded)
    adv, ret = [0.0] * length, [0.0] * length
    next_value, next_adv = 0.0, 0.0
    for i in reversed(actions):
        delta = folded[i] + gamma * next_value - v[i]
        adv[i] = delta + gamma * lam * next_adv
        ret[i] = adv[i] + v[i]
        next_value, next_adv = v[i], adv[i]
    return adv, ret


def reference(rewards, values, mask, gamma, lams):
    rows = [
        reference_row(r, v, m, gamma, lam)
        for r, v, m, lam in zip(rewards.tolist(), values.tolist(), mask.tolist(), lams)
    ]
    return t(*[a for a, _ in rows]), t(*[b for _, b in rows])


def random_batch(n, length, seed):
    """Multi-turn rows: action runs broken by tool-output runs, then right padding of random length
    (some rows all padding, some starting with tool tokens). Masked tokens carry rewards too (folded);
    padding carries 0 as the contract asks, and NaN values (never read)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, length, generator=g, dtype=F64)
    values = torch.randn(n, length, generator=g, dtype=F64)
    run_is_action = torch.rand(n, length // 10 + 1, generator=g) > 0.35  # runs of 10 tokens
    mask = run_is_action.repeat_interleave(10, dim=1)[:, :length].to(F64)
    lengths = torch.randint(0, length + 1, (n,), generator=g)
    padding = torch.arange(length)[None, :] >= lengths[:, None]  # (N, T)
    mask[padding] = 0.0
    rewards[padding] = 0.0
    values[padding] = math.nan
    return rewards, values, mask


# Hand example, one row: action tokens 0, 1, 4; tokens 2, 3 are tool output, token 5 trailing env text.
#   rewards [0, .5, .25, 0, 1, .125] fold to action rewards r = [0, .5+.25+0, 1+.125] = [0, .75, 1.125]
#   values at the action tokens V = [.5, 1, 2]; masked values are NaN (never read). gamma = lam = .5:
#   k=3: delta = 1.125 + 0 - 2 = -.875                 A = -.875                       R = 1.125
#   k=2: delta = .75 + .5*2 - 1 = .75                  A = .75 + .25*(-.875) = .53125  R = 1.53125
#   k=1: delta = 0 + .5*1 - .5 = 0                     A = 0 + .25*.53125 = .1328125   R = .6328125
NAN = math.nan
HAND_R = t(0, 0.5, 0.25, 0, 1, 0.125)[None]
HAND_V = t(0.5, 1, NAN, NAN, 2, NAN)[None]
HAND_M = t(1, 1, 0, 0, 1, 0)[None]


def test_hand_example_tool_tokens_in_the_middle():
    adv, ret = G.gae(HAND_R, HAND_V, HAND_M, gamma=0.5, lam=0.5)
    assert torch.equal(adv, t(0.1328125, 0.53125, 0, 0, -0.875, 0)[None])
    assert torch.equal(ret, t(0.6328125, 1.53125, 0, 0, 1.125, 0)[None])


def test_lam_zero_is_one_step_td():
    # A_k = r_k + gamma V_{k+1} - V_k: [0 + .5*1 - .5, .75 + .5*2 - 1, 1.125 - 2] = [0, .75, -.875]
    adv, ret = G.gae(HAND_R, HAND_V, HAND_M, gamma=0.5, lam=0.0)
    assert torch.equal(adv, t(0, 0.75, 0, 0, -0.875, 0)[None])
    assert torch.equal(ret, t(0.5, 1.75, 0, 0, 1.125, 0)[None])  # r_k + gamma V_{k+1}


def test_float64_equals_the_python_loop_exactly():
    rewards, values, mask = random_batch(24, 97, seed=0)
    for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.7, 0.3)]:
        adv, ret = G.gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = reference(rewards, values, mask, gamma, [lam] * 24)
        assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
        assert adv.dtype == F64


def test_per_row_lambda_tensor():
    rewards, values, mask = random_batch(16, 60, seed=1)
    lams = torch.rand(16, generator=torch.Generator().manual_seed(2), dtype=F64)
    adv, ret = G.gae(rewards, values, mask, 0.98, lams)
    ref_adv, ref_ret = reference(rewards, values, mask, 0.98, lams.tolist())
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
    row_adv, _ = G.gae(rewards[3:4], values[3:4], mask[3:4], 0.98, float(lams[3]))
    assert torch.equal(row_adv[0], adv[3])
    with pytest.raises(ValueError, match="per-row lam"):
        G.gae(rewards, values, mask, 0.98, lams[:3])


def test_float32_is_float64_rounded_once_and_close_to_the_float64_reference():
    rewards, values, mask = random_batch(64, 300, seed=3)
    adv32, ret32 = G.gae(rewards.float(), values.float(), mask.float(), 0.99, 0.95)
    assert adv32.dtype == torch.float32
    # Computed in float64 inside: float32 output == float64 result on the same (rounded) inputs, rounded.
    adv_r, ret_r = G.gae(rewards.float().double(), values.float().double(), mask, 0.99, 0.95)
    assert torch.equal(adv32, adv_r.float()) and torch.equal(ret32, ret_r.float())
    # Against the float64 reference on the unrounded inputs: measured max error 8.0e-7 (this seed; 6.6e-7
    # to 9.3e-7 over seeds 3-7) with |advantages|, |returns| up to ~15: input rounding plus one output
    # rounding. Limit ~10x.
    ref_adv, ref_ret = reference(rewards, values, mask, 0.99, [0.95] * 64)
    err = max(
        (adv32.double() - ref_adv).abs().max().item(), (ret32.double() - ref_ret).abs().max().item()
    )
    assert err < 8e-6


def test_gamma_one_lam_one_gives_reward_to_go():
    # With gamma = lam = 1 the values telescope away: R_k = sum of the rewards from action token k on
    # (those on the masked tokens after it included), A_k = R_k - V_k.
    rewards, values, mask = random_batch(8, 50, seed=4)
    adv, ret = G.gae(rewards, values, mask, 1.0, 1.0)
    act = mask > 0
    to_go = rewards.flip(1).cumsum(1).flip(1)  # (N, T) sum of rewards from t on; padding adds 0
    # Rewards on masked tokens BEFORE the first action token belong to no action; to_go counts them only
    # at positions before them, which are masked, so the comparison on action tokens is unaffected.
    torch.testing.assert_close(ret[act], to_go[act], atol=1e-12, rtol=0)
    torch.testing.assert_close(adv[act], (to_go - values)[act], atol=1e-12, rtol=0)
    assert torch.all(ret[~act] == 0) and torch.all(adv[~act] == 0)
    # The critic's lam = 1 target is Monte-Carlo: other values give the same returns.
    _, ret_other = G.gae(rewards, values * 3 + 1, mask, 1.0, 1.0)
    torch.testing.assert_close(ret_other, ret, atol=1e-12, rtol=0)


def test_reward_on_masked_tokens_before_any_action_is_dropped_and_empty_rows_are_zero():
    # Row 0: tool tokens first (reward 5 there has no action to credit), then one action token.
    # Row 1: no action token at all.
    rewards = t(5, 0, 1)[None].repeat(2, 1)
    mask = t(0, 0, 1, 0, 0, 0).view(2, 3)
    adv, ret = G.gae(rewards, t(0, 0, 0.5)[None].repeat(2, 1), mask, 1.0, 1.0)
    assert torch.equal(adv, t(0, 0, 0.5, 0, 0, 0).view(2, 3))  # 1 - .5
    assert torch.equal(ret, t(0, 0, 1, 0, 0, 0).view(2, 3))


def test_per_sample_lists_equal_the_reference_rows():
    # Ragged rows of different lengths (incl. one of length 0 and one all tool tokens) go through padding.
    rewards, values, mask = random_batch(10, 40, seed=5)
    lens = [40, 0, 7, 23, 1, 40, 12, 3, 39, 18]
    r = [rewards[i, :n] for i, n in enumerate(lens)]
    v = [values[i, :n].nan_to_num(0.0) for i, n in enumerate(lens)]
    m = [mask[i, :n] for i, n in enumerate(lens)]
    m[2] = torch.zeros(7, dtype=F64)
    adv, ret = G.gae_per_sample(r, v, m, 0.95, 0.9)
    for i, n in enumerate(lens):
        ref_a, ref_r = reference_row(r[i].tolist(), v[i].tolist(), m[i].tolist(), 0.95, 0.9)
        assert (
            adv[i].shape == (n,)
            and torch.equal(adv[i], t(*ref_a))
            and torch.equal(ret[i], t(*ref_r))
        )
    assert G.gae_per_sample([], [], [], 0.9, 0.9) == ([], [])


def test_token_rewards_outcome_kl_and_turns():
    # Response 0: actions 0-2, tool 3-4, actions 5-6, trailing env tokens 7-8 -> outcome on token 6.
    # Response 1: all actions -> outcome on its last token. Response 2: no action token -> zeros.
    masks = [t(1, 1, 1, 0, 0, 1, 1, 0, 0), t(1, 1), t(0, 0, 0)]
    kl = [t(0.5, 0.25, 1, math.inf, math.nan, 0.5, 2, 9, 9), t(1, -1), t(1, 1, 1)]
    out = G.token_rewards(
        t(1.0, -1.0, 7.0),
        masks,
        kl=kl,
        kl_coef=0.5,
        turn_rewards=[[(2, 0.75), (2, 0.25), (3, 0.5)], [], [(1, 3.0)]],
    )
    # -0.5 * kl on actions; +1 on token 6; turn rewards 1 at token 2 (.75 + .25), .5 on tool token 3.
    f32 = torch.float32
    assert torch.equal(out[0], t(-0.25, -0.125, -0.5 + 1, 0.5, 0, -0.25, -1 + 1, 0, 0, dtype=f32))
    assert torch.equal(out[1], t(-0.5, 0.5 - 1, dtype=f32))
    assert torch.equal(out[2], torch.zeros(3, dtype=f32))
    # Without KL the outcome alone, still on the last action token.
    plain = G.token_rewards(t(2.0, 3.0, 1.0), masks)
    assert torch.equal(plain[0], t(0, 0, 0, 0, 0, 0, 2, 0, 0, dtype=f32))
    assert torch.equal(plain[1], t(0, 3, dtype=f32))
    with pytest.raises(ValueError, match="index 9"):
        G.token_rewards(t(1.0), masks[:1], turn_rewards=[[(9, 1.0)]])


def test_whiten_over_action_tokens_only():
    rewards, values, mask = random_batch(12, 30, seed=6)
    adv, _ = G.gae(rewards, values, mask, 0.99, 0.95)
    w = G.whiten(adv * 4 + 3, mask)
    act = mask > 0
    torch.testing.assert_close(w[act].mean(), torch.tensor(0.0, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        w[act].var(unbiased=True), torch.tensor(1.0, dtype=F64), atol=1e-8, rtol=0
    )
    assert torch.all(w[~act] == 0)
    # Lists give the same numbers; shift_mean=False keeps the mean: x / std + ... + mean.
    rows = G.whiten([adv[i] * 4 + 3 for i in range(12)], [mask[i] for i in range(12)])
    assert torch.equal(torch.stack(rows), w)
    # Hand case: [1, x, 3] with the middle masked -> mean 2, unbiased var ((1)+(1))/1 = 2.
    s = 1 / math.sqrt(2 + 1e-8)
    torch.testing.assert_close(G.whiten(t(1, 99, 3), t(1, 0, 1)), t(-s, 0, s), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        G.whiten(t(1, 99, 3), t(1, 0, 1), shift_mean=False), t(2 - s, 0, 2 + s), atol=1e-12, rtol=0
    )
    assert torch.equal(G.whiten(t(1, 2), t(0, 0)), t(0, 0))  # no action token


def test_adaptive_lambda():
    # alpha = .05 (VAPO): len 100 -> 1 - 1/5 = .8; 1000 -> .98; 20 -> 0; 10 -> -1 clamped to 0; 0 -> 0.
    lam = G.adaptive_lambda(torch.tensor([100, 1000, 20, 10, 0]), alpha=0.05)
    torch.testing.assert_close(lam, t(0.8, 0.98, 0, 0, 0), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="alpha"):
        G.adaptive_lambda(torch.tensor([10]), alpha=0.0)


def test_advantages_and_returns_composes_the_pieces_the_driver_uses():
    """The driver's GAE (issue 39: no trainer round trip): outcome rewards + KL, lam for the policy and its
    own lam_critic for the returns, VAPO's length-adaptive lambda, whitening over action tokens."""
    g = torch.Generator().manual_seed(0)
    masks = [torch.tensor([1.0, 1, 0, 1]), torch.tensor([1.0, 1, 1])]
    values = [
        torch.randn(4, generator=g, dtype=torch.float64),
        torch.randn(3, generator=g, dtype=torch.float64),
    ]
    kl = [
        torch.rand(4, generator=g, dtype=torch.float64),
        torch.rand(3, generator=g, dtype=torch.float64),
    ]
    seq = torch.tensor([1.0, -0.5], dtype=torch.float64)
    adv, ret = G.advantages_and_returns(
        seq,
        values,
        masks,
        kl,
        gamma=0.9,
        lam=0.8,
        lam_critic=1.0,
        whiten_advantages=False,
        kl_coef=0.1,
    )
    rewards = G.token_rewards(seq, masks, kl, 0.1)
    want_adv, _ = G.gae_per_sample(rewards, values, masks, 0.9, 0.8)
    _, want_ret = G.gae_per_sample(rewards, values, masks, 0.9, 1.0)  # the critic's own lambda
    for a, w in zip(adv + ret, want_adv + want_ret):
        assert a.dtype == torch.float32 and torch.equal(a, w.float())
    vapo, _ = G.advantages_and_returns(
        seq, values, masks, None, gamma=1.0, lam=0.9, lam_actor_alpha=0.05
    )
    lam_i = G.adaptive_lambda(torch.tensor([3.0, 3.0]), 0.05)  # 1 - 1 / (0.05 * 3 action tokens)
    want = G.whiten(
        G.gae_per_sample(G.token_rewards(seq, masks), values, masks, 1.0, lam_i)[0], masks
    )
    assert all(torch.equal(a, w.float()) for a, w in zip(vapo, want))


def test_the_drivers_gae_refuses_a_kl_reward_without_log_probs():
    import dataclasses

    from rlmega.learner.actor_api import advantages_and_returns
    from rlmega.config.schema import AlgorithmConfig
    from rlmega.testing.batches import random_batch

    batch = random_batch(3, seed=0)
    batch = dataclasses.replace(
        batch, old_values=[torch.zeros(n) for n in batch.response_lens()], old_logprobs=None
    )
    algo = AlgorithmConfig(advantage_estimator="gae", kl_coef=0.1, kl_in_reward=True)
    with pytest.raises(ValueError, match="kl_in_reward needs batch.old_logprobs"):
        advantages_and_returns(batch, algo)
