"""Gemma 3 (Gemma3ForCausalLM) on megatron-core's local layer spec.

    spec = layer_spec()                            # one layer spec for every layer
    finish_model(model, hf_config)                 # after GPTModel(...): embedding scale, the windows' RoPE

What megatron-core 0.16.1 has for it, set by hf_config (``gemma3_config_kwargs``), each measured against
transformers (tests/multiproc/test_hf_parity.py): sliding-window and global layers (``window_size`` (window - 1, 0)
and ``window_attn_skip_freq`` as a per-layer list, which rlmega's ``PackedSDPAttention`` reads), per-head q/k norms
(``qk_layernorm``), the softmax scale ``query_pre_attn_scalar ** -0.5`` (``softmax_scale``), the gated tanh-GELU
MLP (``hf_config.gelu_tanh``), norms stored centred on 0 (``layernorm_zero_centered_gamma``; computed by rlmega's
``ZeroCentered`` norms, in float32 as transformers' Gemma3RMSNorm: the local spec's torch norm has no such form).

What it lacks, built here:
- the norms after attention and after the MLP (transformers' ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``; megatron-core's TransformerLayer has norms before its sublayers only): the attention
  and the MLP of the spec are subclasses that normalise their own output, before the residual add;
- the embedding scale (``sqrt(hidden_size)`` in the weights' dtype, transformers' Gemma3TextScaledWordEmbedding): a
  forward hook on the first stage's embedding;
- RoPE with a base of its own on the sliding layers (``rope_local_base_freq``, 10k, against 1M for the global ones):
  a second megatron-core ``RotaryEmbedding`` on the model chunk (``rlmega_window_rope``), whose angles
  ``packed_attention.packed_rows`` hands the windowed layers; linear RoPE scaling of the global layers (Gemma 3's
  larger models) divides the inverse frequencies as transformers does.

Not built, refused at load (rlmega/config/hf_support.py): attention/final logit soft-capping, bidirectional
attention, attention bias, other RoPE types; context parallelism with sliding windows (megatron/packed_attention.py).
"""

from __future__ import annotations

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from rlmega.megatron.norms import ZeroCenteredHeadRMSNorm, ZeroCenteredTokenRMSNorm
from rlmega.megatron.packed_attention import PackedSDPAttention


class PostNormSelfAttention(SelfAttention):
    """Self-attention whose output goes through Gemma's post-attention norm before the residual add."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_attention_norm = ZeroCenteredTokenRMSNorm(
            config, config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        if bias is not None:  # add_bias_linear is off for Gemma 3: the bias would go after the norm
            raise ValueError("PostNormSelfAttention: an output bias is not supported")
        return self.post_attention_norm(output), None


class PostNormMLP(MLP):
    """The MLP whose output goes through Gemma's post-feedforward norm before the residual add."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_mlp_norm = ZeroCenteredTokenRMSNorm(
            config, config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, hidden_states, *args, **kwargs):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            raise ValueError("PostNormMLP: an output bias is not supported")
        return self.post_mlp_norm(output), None


def layer_spec():
    """megatron-core's local layer spec (q/k norms) with Gemma 3's norms, post-norm sublayers and rlmega's attention."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = ZeroCenteredTokenRMSNorm
    layer.self_attention.module = PostNormSelfAttention
    attention = layer.self_attention.submodules
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredHeadRMSNorm
    attention.core_attention = PackedSDPAttention
    layer.mlp.module = PostNormMLP
    return spec


def finish_model(
    model, embedding_scale: float, window_rope_base: float | None, rope_linear_factor: float | None
):
    """What GPTModel cannot be told: the first stage's embedding scale, the sliding layers' RoPE base (None: the
    same as the global layers'), the global layers' linear RoPE scaling (None: none)."""
    if model.pre_process:
        # transformers multiplies by the scale cast to the weights' dtype
        def scale(_module, _inputs, output):
            return output * torch.tensor(embedding_scale, dtype=output.dtype, device=output.device)

        model.embedding.register_forward_hook(scale)
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None and rope_linear_factor:
        # transformers' "linear" RoPE: inv_freq / factor
        rope.inv_freq = rope.inv_freq / rope_linear_factor
    if window_rope_base is not None:
        model.rlmega_window_rope = RotaryEmbedding(
            model.config.kv_channels,
            rotary_percent=1.0,
            rotary_base=window_rope_base,
            use_cpu_initialization=True,
        )
