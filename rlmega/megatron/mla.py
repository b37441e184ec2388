"""DeepSeek-V3's multi-latent attention on megatron-core's local layer spec, over rlmega's packed rows.

    block = decoder_block_spec(config, vp_stage)     # one layer spec per layer built on this stage

megatron-core 0.16.1 builds MLA (``MLASelfAttention``) from the local spec only with help
(docs/deepseek_v3_megatron.md, each point measured against transformers):
- the core attention must take MLA's ``k_channels`` / ``v_channels`` (rlmega's ``PackedSDPAttention`` does);
- the spec's latent q/kv norms exist only with ``qk_layernorm`` (hf_config sets it: without it they are
  identities, with no error); they are ``TokenRMSNorm``s, whose sequence-parallel mark has megatron sum their
  gradients over TP (under SP each TP rank normalises its share of the tokens);
- MLA reads any ``packed_seq_params`` as THD (it squeezes the batch dimension away), so rlmega's sbhd
  ``RowPacking`` goes to the core attention only (``RowPackedMLASelfAttention``), while MLA's own RoPE takes each
  token's angles from ``packed_attention.packed_rows``;
- the latent down-projections (``linear_q_down_proj``, ``linear_kv_down_proj``) replicated on every TP rank, as
  Transformer Engine's spec has them (its ``duplicated`` linears), not the local spec's column-parallel ones:
  there, the rope part of the kv latent (``k_pos_emb``), used by every TP rank's heads, comes back through an
  all-gather whose backward only splits, so its gradient missed the other ranks' heads (TP2+SP's grad norm was
  9.2e-5 off TP1's at the first step, 8e-4 at the second; replicated: at TP1's). The replicated ``Linear``
  (megatron-core's, with the sequence-parallel mark: its gradient summed over TP) keeps each rank's tokens;
- the first ``first_k_dense_replace`` layers are dense (``moe_layer_freq``), the others MoE with shared experts;
- its TELinear check needs ``cpu_support.mla_without_transformer_engine`` (process start, runtime.init_megatron).

And the router's correction bias (``count_expert_tokens``): kept as the checkpoint has it by default
(``actor.moe_router_bias_update_rate`` 0, hf_config), or moved after each optimizer step by megatron-core's
aux-loss-free update (finalize_model_grads) from each expert's count of the step's tokens. megatron-core 0.16.1
counts them as ``routing_map & ~padding_mask``, (tokens, experts) against the (tokens,) padding mask rlmega gives
its routers: a shape error, or with as many tokens as experts a wrong count with no error. rlmega counts with the
mask on the token axis, and not at all when the bias stays.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from rlmega.megatron.norms import TokenRMSNorm
from rlmega.megatron.packed_attention import PackedSDPAttention, RowPacking


class LatentRMSNorm(TokenRMSNorm):
    """The latent q/kv norms with DeepSeek's own eps, 1e-6, whatever ``rms_norm_eps`` says: transformers' and
    DeepSeek's modeling code build them with their RMSNorm's default (megatron-core would pass the config's eps,
    1e-5 for Moonlight's config)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps=1e-6)


class RowPackedMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose q/k/v projections see rlmega's packed rows as plain sbhd rows (no packing: they are
    per token), and whose core attention gets the ``RowPacking`` (causal per packed sequence)."""

    def get_query_key_value_tensors(
        self,
        hidden_states,
        key_value_states=None,
        position_ids=None,
        packed_seq_params=None,
        *args,
        **kwargs,
    ):
        if isinstance(packed_seq_params, RowPacking):
            packed_seq_params = None
        return super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, packed_seq_params, *args, **kwargs
        )


def decoder_block_spec(config, vp_stage: int | None = None):
    """The TransformerBlockSubmodules of this pipeline stage (virtual stage ``vp_stage``): megatron-core's per-layer
    local specs (dense or MoE by ``config.moe_layer_freq``) with rlmega's attention and norms."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    # dense and MoE specs are shared objects
    for spec in {id(s): s for s in block.layer_specs}.values():
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = TokenRMSNorm
        attention = layer.self_attention
        attention.module = RowPackedMLASelfAttention
        attention.submodules.core_attention = PackedSDPAttention
        attention.submodules.linear_q_down_proj = attention.submodules.linear_kv_down_proj = (
            ReplicatedLinear
        )
        attention.submodules.q_layernorm = attention.submodules.kv_layernorm = LatentRMSNorm
    block.layer_norm = TokenRMSNorm
    return block


def count_expert_tokens(model) -> int:
    """Every router with an expert bias counts each expert's real tokens of a training forward (what megatron-core's
    bias update reads) with the padding mask on the token axis, or, when the bias never moves (update rate 0), not at
    all. Returns how many routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    n = 0
    for module in model.modules():
        if isinstance(module, TopKRouter) and module.enable_expert_bias:
            module._apply_expert_bias = (
                _count_tokens(module)
                if module.config.moe_router_bias_update_rate
                else lambda routing_map, padding_mask=None: None
            )
            n += 1
    return n


def _count_tokens(router):
    def count(routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        """routing_map (tokens, experts) bool; padding_mask (tokens,) bool, True = padding. As megatron-core:
        training forwards only (not log-prob passes), recomputation aside."""
        if not torch.is_grad_enabled():
            return
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)

    return count
