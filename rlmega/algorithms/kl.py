"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman, "Approximating KL
divergence", 2020). Tokens are sampled from the policy, so with log_ratio = ref - logp:

    k1 = -log_ratio                     unbiased, high variance, can be negative per token
    k2 = 0.5 * log_ratio^2              biased, low variance, >= 0
    k3 = exp(log_ratio) - log_ratio - 1 unbiased, low variance, >= 0 (verl's "low_var_kl")

"Unbiased" is about the VALUE: E_{y~pi}[k1] = E_{y~pi}[k3] = KL(pi||ref). As a LOSS TERM what matters
is the expected GRADIENT, taken through logp with the sampled tokens held fixed, and the three differ.
Write p = pi(y), q = ref(y), sum over the vocabulary, and use sum_y grad p = grad 1 = 0:

    k1: grad k1 = grad log p.  E_pi = sum p grad log p = sum grad p = 0.
        Zero expected gradient on-policy: k1 in the loss regularises nothing (only noise).
    k2: grad k2 = (log p - log q) grad log p.  E_pi = sum (log p - log q) grad p
        = grad sum p (log p - log q) - sum p grad log p = grad KL(pi||ref).
        The gradient of the REVERSE KL, the same direction the `kl_ref` metric reports.
    k3: grad k3 = (1 - q/p) grad log p.  E_pi = sum (p - q) grad log p = -sum q grad log p
        = grad sum q (log q - log p) = grad KL(ref||pi).
        The gradient of the FORWARD KL (mass-covering), although its value estimates KL(pi||ref).

So in the loss: k2 when the penalty should act on the KL that is reported, k3 for the forward KL
(verl's "low_var_kl" default), never k1 (the config refuses it). In the reward (algorithm.kl_in_reward)
only the value counts and k1/k3 are the unbiased choices. These are per-position statements: each
token's distribution given its prefix; tests/unit/test_algorithms.py checks them exactly on a small
categorical distribution with autograd. The `kl_ref` metric is always the k3 value (unbiased, >= 0).

Pure functions over flat token tensors (T,); masking and averaging belong to `losses.aggregate`,
except `sequence_kl`, the per-sequence penalty of algorithm.kl_in_reward (a reward, not a loss term).
"""

from typing import Sequence

import torch

ESTIMATORS = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8 is far past any ratio that carries signal, and keeps exp() finite in fp16/bf16/fp32
# when the reference assigns a sampled token a log-prob tens of nats below the policy's.
LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate.

    logprobs: (T,) log pi(y_t) under the policy being trained (gradients flow through it);
    ref_logprobs: (T,) log pi_ref(y_t); estimator: "k1" | "k2" | "k3" -> kl: (T,).
    All three are exactly 0 where logprobs == ref_logprobs.
    For k3 the log-ratio is clamped to [-20, 20] before exp for stability; the same clamped value is
    used in the linear term so that k3 = f(x) with f(x) = e^x - x - 1 >= 0 still holds everywhere.
    Unlike verl, the result itself is not clamped.
    """
    log_ratio = ref_logprobs - logprobs  # (T,)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")


def sequence_kl(
    logprobs: Sequence[torch.Tensor],
    ref_logprobs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    estimator: str,
) -> torch.Tensor:
    """Per-sequence KL penalty of algorithm.kl_in_reward: the sum of the per-token estimate over the
    tokens the loss trains on.

    logprobs, ref_logprobs, masks: N tensors, sample i's (L_i,) over its response tokens; masks 1.0 on
    model-sampled tokens, 0.0 on tool output and on every token of a response algorithm.overlong=mask took
    out (the RolloutBatch's response_mask) -> (N,) float. Masked tokens add nothing, even where their
    estimate is inf/NaN: tool tokens were never sampled by the policy, so their log-probs say nothing
    about KL(pi||ref), and a sample out of the loss must not be penalised through its reward either.
    """
    out = [
        torch.where(m > 0, kl_penalty(lp, ref, estimator), torch.zeros_like(lp)).sum()
        for lp, ref, m in zip(logprobs, ref_logprobs, masks, strict=True)
    ]
    return torch.stack(out) if out else torch.zeros(0)
