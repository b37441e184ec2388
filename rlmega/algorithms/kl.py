"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman, "Approximating KL
divergence", 2020). Tokens are sampled from the policy, so with log_ratio = ref - logp:

    k1 = -log_ratio                     unbiased, high variance, can be negative per token
    k2 = 0.5 * log_ratio^2              biased, low variance, >= 0
    k3 = exp(log_ratio) - log_ratio - 1 unbiased, low variance, >= 0 (verl's "low_var_kl")

Pure functions over flat token tensors (T,); masking and averaging belong to `losses.aggregate`.
"""
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
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
