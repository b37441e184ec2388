"""Generalized Advantage Estimation (Schulman et al. 2016) for PPO with a learned critic.

Only ACTION tokens (mask > 0: sampled by the policy) are steps of the episode. Tool output and other
environment tokens inside a multi-turn response (mask == 0), and padding, are not actions: they get
no advantage and no return (both 0), and they do not break the credit chain. Row i's action tokens
a_1..a_K form the episode, as if the masked tokens were not there:

    delta_k = r_k + gamma * V_{k+1} - V_k        V_{K+1} = 0: each response ends its episode
    A_k     = delta_k + gamma * lam * A_{k+1}     A_{K+1} = 0
    R_k     = A_k + V_k                          the critic's regression target

A reward placed on a masked token is folded onto the previous action token (the action whose
consequence the environment's tokens are); one on masked tokens before the first action token has
no action to credit and is dropped. Padding must therefore carry reward 0.

Decoupled GAE (VAPO, Yue et al. 2025): the actor's advantages use a length-adaptive lam_actor
(`adaptive_lambda`), the critic's returns a constant lam_critic (VAPO: 1.0, unbiased Monte-Carlo
targets), so `gae` is called twice and each caller keeps one of its two outputs.

Pure functions: tensors and numbers in, tensors out. `gae` is the padded (N, T) core; `token_rewards`,
`gae_per_sample` and `whiten` also take the RolloutBatch's ragged per-sample (T_i,) lists.
"""

from __future__ import annotations

from typing import Sequence

import torch

F64 = torch.float64


def _out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The inputs' common float dtype; integer inputs give float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.float32


def token_rewards(
    seq_rewards: torch.Tensor,
    response_mask: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    turn_rewards: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> list[torch.Tensor]:
    """Per-token rewards of N responses, the `rewards` input of `gae`.

    seq_rewards: (N,) outcome reward per response; response_mask: N tensors (T_i,), > 0 on action tokens;
    kl: N tensors (T_i,) per-token KL estimate (algorithm.kl_in_reward) or None; kl_coef: its weight;
    turn_rewards: N lists of (response token index, reward) or None -> N tensors (T_i,) float32.

    The outcome reward sits on the LAST ACTION token: trailing tool/env tokens are not the policy's,
    and `gae` would fold a reward there back onto that token anyway. Action tokens get -kl_coef * kl[t]
    (masked tokens none: their KL may be inf/NaN and was never the policy's); kl_coef == 0 skips it.
    Turn rewards add at their indices (several at one index sum); one on a masked token is folded by
    `gae` onto the previous action token. A response with no action token is no step of any episode:
    its rewards go nowhere and it gets all zeros.
    """
    n = len(response_mask)
    if seq_rewards.shape != (n,):
        raise ValueError(f"seq_rewards has shape {tuple(seq_rewards.shape)}, expected ({n},)")
    for name, lists in (("kl", kl), ("turn_rewards", turn_rewards)):
        if lists is not None and len(lists) != n:
            raise ValueError(f"{name} has {len(lists)} entries for {n} responses")
    out = []
    for i, mask in enumerate(response_mask):
        act = mask > 0  # (T_i,)
        r = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # (T_i,)
        action_idx = torch.nonzero(act).flatten()
        if action_idx.numel() == 0:
            out.append(r)
            continue
        if kl is not None and kl_coef != 0.0:
            penalty = -kl_coef * kl[i].to(torch.float32)  # (T_i,)
            r = torch.where(act, penalty, r)
        last = action_idx[-1]
        r[last] += seq_rewards[i].to(torch.float32)
        for idx, value in turn_rewards[i] if turn_rewards is not None else ():
            if not 0 <= idx < r.numel():
                raise ValueError(
                    f"turn reward index {idx} outside response {i} of {r.numel()} tokens"
                )
            r[idx] += value
        out.append(r)
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the action tokens of each row (see the module docstring for the recursion).

    rewards: (N, T), values: (N, T) the critic's V(s_t), mask: (N, T) > 0 on action tokens; gamma: float;
    lam: float or (N,) per-row lambda -> (advantages (N, T), returns (N, T)), 0 where mask == 0,
    in the inputs' common float dtype.

    Computed in float64 whatever the input and rounded once at the end, so float32 results equal the
    float64 ones rounded, and float64 inputs give exactly the values of a plain-float loop that walks
    each row backwards doing the same operations in the same order (tests/unit/test_gae.py). One
    backward scan over T, vectorised over N. Values on masked tokens are never read (NaN is fine).
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must be the same (N, T)"
        )
    n, length = rewards.shape
    if torch.is_tensor(lam):
        if lam.shape != (n,):
            raise ValueError(f"per-row lam has shape {tuple(lam.shape)}, expected ({n},)")
        lam = lam.to(device=rewards.device, dtype=F64)
    gamma_lam = gamma * lam  # float or (N,): the same double product as the reference's gamma * lam
    r, v, act = rewards.to(F64), values.to(F64), mask > 0  # (N, T)
    adv = torch.zeros_like(r)  # (N, T)
    zero = torch.zeros(n, dtype=F64, device=r.device)
    pending = zero  # (N,) rewards of the masked tokens after t, waiting for an action token
    next_value = zero  # (N,) V at the next action token; 0 past the last one (terminal)
    next_adv = zero  # (N,) A at the next action token
    for t in reversed(range(length)):
        a = act[:, t]  # (N,)
        r_t = r[:, t] + pending  # (N,)
        delta = r_t + gamma * next_value - v[:, t]  # (N,)
        adv_t = delta + gamma_lam * next_adv  # (N,)
        adv[:, t] = torch.where(a, adv_t, zero)
        # A masked token passes the chain through untouched and hands its reward to the action before.
        next_value = torch.where(a, v[:, t], next_value)
        next_adv = torch.where(a, adv_t, next_adv)
        pending = torch.where(a, zero, r_t)
    # (N, T); where: v may be NaN on masked
    returns = torch.where(act, adv + v, torch.zeros_like(adv))
    dtype = _out_dtype(rewards, values)
    return adv.to(dtype), returns.to(dtype)


def _pad(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """N tensors (T_i,) -> (N, length), zero-padded on the right."""
    out = rows[0].new_zeros((len(rows), length))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def gae_per_sample(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`gae` on ragged per-sample lists: rewards, values, masks: N tensors (T_i,); lam: float or (N,)
    -> (advantages, returns): N tensors (T_i,) each. Pads to (N, max T_i) with zeros (padding is masked
    and carries reward 0, so it changes nothing), runs `gae`, cuts the padding off again.
    """
    if not (len(rewards) == len(values) == len(masks)):
        raise ValueError(f"{len(rewards)} rewards, {len(values)} values, {len(masks)} masks")
    if len(rewards) == 0:
        return [], []
    lengths = [m.numel() for m in masks]
    for i, (r, v) in enumerate(zip(rewards, values)):
        if r.numel() != lengths[i] or v.numel() != lengths[i]:
            raise ValueError(
                f"sample {i}: rewards {r.numel()}, values {v.numel()}, mask {lengths[i]} tokens"
            )
    width = max(lengths)
    adv, ret = gae(_pad(rewards, width), _pad(values, width), _pad(masks, width), gamma, lam)
    return (
        [adv[i, :n] for i, n in enumerate(lengths)],
        [ret[i, :n] for i, n in enumerate(lengths)],
    )


def _whiten_flat(x: torch.Tensor, act: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    """Whiten x (any shape) over the entries where act is True; other entries 0."""
    x64 = x.to(F64)
    sel = x64[act]  # (M,)
    if sel.numel() == 0:
        return torch.zeros_like(x)
    mean = sel.mean()
    # Unbiased (divide by M - 1) like verl's masked_whiten; one action token has no spread: var 0.
    var = (
        ((sel - mean) ** 2).sum() / (sel.numel() - 1) if sel.numel() > 1 else torch.zeros_like(mean)
    )
    out = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(act, out, torch.zeros_like(out)).to(x.dtype)


def whiten(
    values: torch.Tensor | Sequence[torch.Tensor],
    mask: torch.Tensor | Sequence[torch.Tensor],
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor | list[torch.Tensor]:
    """Whiten advantages over the WHOLE batch's action tokens (each token counts once).

    values, mask: (N, T) tensors, or N tensors (T_i,) each -> the same layout and dtype.
    (x - mean) / sqrt(var + eps) with mean and UNBIASED var over mask > 0 entries only, computed in
    float64; shift_mean=False adds the mean back (scale only). Masked entries are 0 in the output,
    and all zeros come back when no entry is an action token.
    """
    if torch.is_tensor(values):
        if values.shape != mask.shape:
            raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
        return _whiten_flat(values, mask > 0, shift_mean, eps)
    if len(values) != len(mask):
        raise ValueError(f"{len(values)} value rows for {len(mask)} mask rows")
    if len(values) == 0:
        return []
    flat = _whiten_flat(torch.cat(list(values)), torch.cat(list(mask)) > 0, shift_mean, eps)
    return list(flat.split([v.numel() for v in values]))


def adaptive_lambda(response_lens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive lambda for the ACTOR's advantages: lam_i = 1 - 1 / (alpha * len_i).

    response_lens: (N,) int or float; alpha > 0 (VAPO: 0.05) -> (N,) float64 in [0, 1].
    GAE weighs the step k ahead by lam^k, total ~ 1 / (1 - lam) = alpha * len: the horizon the
    estimator looks over grows with the response, so long responses are not all bias. Pass the number
    of ACTION tokens (mask sum): masked tokens are no steps of the GAE chain. Short responses
    (alpha * len <= 1, including len 0) clamp to 0. The critic uses its own constant lam_critic.
    """
    if alpha <= 0:
        raise ValueError(f"adaptive lambda alpha must be > 0, got {alpha}")
    lam = 1.0 - 1.0 / (alpha * response_lens.to(F64))  # (N,); len 0 -> -inf -> clamped to 0
    return lam.clamp(0.0, 1.0)


def advantages_and_returns(
    seq_rewards: torch.Tensor,
    old_values: Sequence[torch.Tensor],
    response_mask: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None,
    *,
    gamma: float,
    lam: float,
    lam_critic: float | None = None,
    lam_actor_alpha: float | None = None,
    whiten_advantages: bool = True,
    kl_coef: float = 0.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO with a critic: per-token advantages for the policy and returns for the critic, per sample (float32).

    seq_rewards: (N,) the judges' reward of each sample, given on its last action token; old_values: the
    critic's (response_len,) per sample; response_mask: (response_len,) per sample, 0 on tool output (no
    action: no reward, advantage or return, and GAE's credit passes over it); kl: a (response_len,) per-token
    KL penalty per sample (``kl_coef`` weighs it) or None. Advantages use ``lam`` (or VAPO's length-adaptive
    lambda with ``lam_actor_alpha``), returns ``lam_critic`` (default ``lam``); advantages are whitened over the
    batch's action tokens when ``whiten_advantages``.
    """
    rewards = token_rewards(seq_rewards, response_mask, kl, kl_coef)
    lam_c = lam if lam_critic is None else lam_critic
    lam_a = lam
    if lam_actor_alpha is not None:  # VAPO: longer responses look further ahead
        lam_a = adaptive_lambda(
            torch.tensor([float(m.sum()) for m in response_mask]), lam_actor_alpha
        )
    advantages, returns = gae_per_sample(rewards, old_values, response_mask, gamma, lam_a)
    if lam_actor_alpha is not None or lam_c != lam:  # decoupled: the critic's own lambda
        returns = gae_per_sample(rewards, old_values, response_mask, gamma, lam_c)[1]
    if whiten_advantages:
        advantages = whiten(advantages, response_mask)
    return [x.float() for x in advantages], [x.float() for x in returns]
