# ruff: noqa: E501  (a spike: its long measurement lines are kept as they ran)
"""DeepSeek-V3 (MLA + sigmoid group-limited MoE) on megatron-core 0.16.1's LOCAL layer spec, on CPU,
against transformers' DeepseekV3ForCausalLM (float32, eager attention).

    python tools/spikes/deepseek_v3_megatron_parity.py                 # TP1, world 1, gloo
    python tools/spikes/deepseek_v3_megatron_parity.py --tp 2          # TP2, 2 ranks (mp.spawn, gloo)
    python tools/spikes/deepseek_v3_megatron_parity.py --stock [--stock-dpa] [--stock-te-flag]
                                                  # the stock local spec failing (each fix alone)
    python tools/spikes/deepseek_v3_megatron_parity.py --make-stress   # hf_stress* variants (see make_stress)
    python tools/spikes/deepseek_v3_megatron_parity.py --hf-dir runs/dsv3_spike/hf_stress_yarn [--wrong X]

A spike (issue 42): the measurements of docs/deepseek_v3_megatron.md, before rlmega's Megatron learner takes
DeepSeek-V3. Nothing under site-packages is edited. The fixes live here:
  * MLADotProductAttention: the local DotProductAttention subclassed to accept MLA's k_channels /
    v_channels (and size its output by v_channels, not kv_channels).
  * the layer spec: q/kv layernorms set explicitly (qk_layernorm=False leaves them IdentityOp),
    per-layer specs for the dense first layer (moe_layer_freq), shared experts come with the MoE spec.
  * patch_mla_without_te(): multi_latent_attention.HAVE_TE = False when TE does not import (its
    isinstance(linear_proj, TELinear) otherwise raises: TELinear is a MagicMock without TE).
  * rlmega.megatron.cpu_support: CUDA-free execution + te_general_gemm=None (router without TE).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(os.environ.get("RLMEGA_SPIKE_DIR", "runs/dsv3_spike"))  # where the tiny HF models are written
HF_DIR = ROOT / "hf"


# ----------------------------------------------------------------------------------------------
# The HF model
# ----------------------------------------------------------------------------------------------
def ensure_hf(path: Path = HF_DIR, num_layers: int = 3) -> None:
    if not (path / "config.json").exists():
        from rlmega.tiny_model import make_tiny_model
        make_tiny_model(str(path), arch="deepseek_v3", num_layers=num_layers, overwrite=True)


def load_hf_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float(), model.model.layers[0].self_attn.scaling


# ----------------------------------------------------------------------------------------------
# HF config -> MLATransformerConfig
# ----------------------------------------------------------------------------------------------
def mla_config(hf: dict, tp: int, rotary_interleaved: bool = False):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    yarn = {}
    if rope_type == "yarn":
        # megatron's YarnRotaryEmbedding + MLA softmax scale; see REPORT.md for what matches HF.
        yarn = dict(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                    mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    elif rope_type == "default":
        # rotary_scaling_factor / mscale_all_dim feed MLA's softmax scale even for plain rope:
        # _yarn_get_mscale(factor, mscale_all_dim) must be 1 -> factor 1 (and mscale_all_dim 0).
        yarn = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        raise ValueError(f"rope_type {rope_type!r} not handled")
    n_layers = hf["num_hidden_layers"]
    dense = int(hf.get("first_k_dense_replace", 0))
    moe_pattern = [0 if i < dense else 1 for i in range(n_layers)]
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError("moe_layer_freq != 1 not handled")
    if hf.get("rms_norm_eps", 1e-6) != 1e-6:
        # HF's q_a_layernorm / kv_a_layernorm use DeepseekV3RMSNorm's default eps=1e-6, NOT rms_norm_eps;
        # megatron uses layernorm_epsilon for every norm.
        print("WARNING: rms_norm_eps != 1e-6: HF's q_a/kv_a layernorms still use 1e-6; megatron will not")
    cfg = MLATransformerConfig(
        num_layers=n_layers,
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],           # the dense layers' MLP
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # --- MLA ---
        multi_latent_attention=True,
        q_lora_rank=hf["q_lora_rank"],                      # None -> linear_q_proj (no q compression)
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],                 # megatron's qk_head_dim is the NoPE part only
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        qk_layernorm=True,                                  # q_a_layernorm / kv_a_layernorm (else IdentityOp)
        rotary_base=theta,
        # HF rope_interleave=True <=> megatron rotary_interleaved=FALSE: MLA's unfused RoPE
        # (rope_utils._apply_rotary_pos_emb_bshd, multi_latent_attention=True) already de-interleaves
        # x -> [x0,x2,..,x1,x3,..] and then rotates halves, exactly HF's apply_rotary_pos_emb_interleave.
        rotary_interleaved=rotary_interleaved,
        **yarn,
        # --- MoE ---
        num_moe_experts=hf["n_routed_experts"],
        moe_layer_freq=moe_pattern,                         # first_k_dense_replace dense layers
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"],
        moe_shared_expert_overlap=False,
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,                 # HF e_score_correction_bias (selection only)
        moe_router_bias_update_rate=0.0,                    # don't let finalize_model_grads move it
        moe_router_num_groups=hf["n_group"],
        moe_router_group_topk=hf["topk_group"],
        moe_router_topk_scaling_factor=float(hf["routed_scaling_factor"]),
        moe_router_dtype="fp32",                            # HF: router linear + sigmoid in float32
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False,
        # --- parallel / CPU ---
        tensor_model_parallel_size=tp,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
    )
    if not hf.get("norm_topk_prob", True) and hf["num_experts_per_tok"] > 1:
        # megatron's sigmoid path ALWAYS renormalises the top-k (moe_utils.py:724): cannot express this.
        raise ValueError("norm_topk_prob=False with sigmoid scoring: megatron-core 0.16.1 cannot reproduce it")
    k, g = hf["num_experts_per_tok"], hf["topk_group"]
    if k // g != 2:
        # megatron scores a group by the sum of its top (topk // group_topk) scores; HF by its top 2.
        raise ValueError(f"group scoring differs: megatron sums top-{k // g} per group, HF top-2")
    return cfg


# ----------------------------------------------------------------------------------------------
# Fixes for the local spec
# ----------------------------------------------------------------------------------------------
def patch_mla_without_te() -> bool:
    """megatron/core/transformer/multi_latent_attention.py:53-65 imports TELinear from
    megatron.core.extensions.transformer_engine, which WITHOUT Transformer Engine still imports
    (extensions/transformer_engine.py:61-77 substitutes te = MagicMock()), so the import succeeds,
    MLA's HAVE_TE is True and TELinear is a MagicMock *instance* (class TELinear(te.pytorch.Linear)
    on a mock yields a mock). multi_latent_attention.py:184-185 then runs
    isinstance(self.linear_proj, TELinear) -> TypeError. Fix: make the module's flag tell the truth.
    Process-global, idempotent; a no-op where TE really imports."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla
    if not te_ext.HAVE_TE and mla.HAVE_TE:
        mla.HAVE_TE = False
        return True
    return False


def _mla_dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        """megatron-core's local DotProductAttention, taking the k_channels / v_channels that
        MultiLatentAttention passes (multi_latent_attention.py:153-164). The parent sizes its output
        as kv_channels * heads / tp (dot_product_attention.py); MLA's value heads are v_head_dim wide,
        so the output size is recomputed from v_channels. The scores use q/k's own last dim, so
        k_channels needs nothing else; MLA passes its softmax_scale explicitly."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                tp = self.pg_collection.tp.size()
                self.hidden_size_per_partition = divide(v_channels * self.config.num_attention_heads, tp)
                self.hidden_size_per_attention_head = v_channels

    return MLADotProductAttention


def layer_specs(config, stock: bool = False, dpa_fix: bool = True):
    """Per-layer specs (dense first layers, MoE after) from the local spec with MLA."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.models.backends import LocalSpecProvider

    def one(num_experts):
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=True if not stock else False,
                                        multi_latent_attention=True, normalization="RMSNorm")
        if not stock or dpa_fix:
            spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention()
        return spec

    dense, moe = one(None), one(config.num_moe_experts)
    specs = [moe if f else dense for f in config.moe_layer_freq]
    return TransformerBlockSubmodules(layer_specs=specs,
                                      layer_norm=LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False))


# ----------------------------------------------------------------------------------------------
# Weights: HF -> megatron (global names; then a TP shard)
# ----------------------------------------------------------------------------------------------
# kind: rep (replicated), col (split dim 0), row (split dim 1), gate_up ([gate_r; up_r] per rank),
#       vocab (pad rows, split dim 0)
def hf_to_mcore(hf_sd: dict, hf: dict, padded_vocab: int) -> dict[str, tuple[str, torch.Tensor]]:
    out = {}
    V, h = hf_sd["model.embed_tokens.weight"].shape

    def vocab(t):
        p = torch.zeros(padded_vocab, h, dtype=t.dtype)
        p[:V] = t
        return p

    out["embedding.word_embeddings.weight"] = ("vocab", vocab(hf_sd["model.embed_tokens.weight"]))
    out["output_layer.weight"] = ("vocab", vocab(hf_sd.get("lm_head.weight", hf_sd["model.embed_tokens.weight"])))
    out["decoder.final_layernorm.weight"] = ("rep", hf_sd["model.norm.weight"])
    dense = int(hf.get("first_k_dense_replace", 0))
    r, nope, heads = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"], hf["num_attention_heads"]
    # MLA's unfused RoPE de-interleaves its input (rope_utils.py:115-118): [t0,t2,..,t1,t3,..]. For HF
    # rope_interleave=True that IS HF's rotation. For rope_interleave=False (rotate_half on the plain
    # layout) store the rope rows interleaved, so megatron's de-interleave restores HF's order:
    # megatron row 2i <- HF row i, row 2i+1 <- HF row r/2 + i.
    interleave = torch.stack([torch.arange(r // 2), torch.arange(r // 2) + r // 2], dim=1).reshape(-1)

    def rope_rows(t, offset):  # t's rows [offset, offset + r) are one rope block
        if hf.get("rope_interleave", True):
            return t
        t = t.clone()
        t[offset:offset + r] = t[offset:offset + r][interleave]
        return t

    def q_rope_rows(t):  # q_b_proj / q_proj: heads x (nope | rope)
        for hd in range(heads):
            t = rope_rows(t, hd * (nope + r) + nope)
        return t

    for L in range(hf["num_hidden_layers"]):
        p, m = f"model.layers.{L}.", f"decoder.layers.{L}."
        a, sa = p + "self_attn.", m + "self_attention."
        out[m + "input_layernorm.weight"] = ("rep", hf_sd[p + "input_layernorm.weight"])
        out[m + "pre_mlp_layernorm.weight"] = ("rep", hf_sd[p + "post_attention_layernorm.weight"])
        # MLA: every tensor maps 1:1, no reordering (HF and megatron share the head-major layouts
        # [heads x (nope | rope)] for q_b_proj, [heads x (nope | v)] for kv_b_proj, [kv_lora | rope] for
        # kv_a_proj_with_mqa).
        if hf.get("q_lora_rank") is not None:
            out[sa + "linear_q_down_proj.weight"] = ("col", hf_sd[a + "q_a_proj.weight"])
            out[sa + "q_layernorm.weight"] = ("rep", hf_sd[a + "q_a_layernorm.weight"])
            out[sa + "linear_q_up_proj.weight"] = ("col", q_rope_rows(hf_sd[a + "q_b_proj.weight"]))
        else:
            out[sa + "linear_q_proj.weight"] = ("col", q_rope_rows(hf_sd[a + "q_proj.weight"]))
        out[sa + "linear_kv_down_proj.weight"] = ("col", rope_rows(hf_sd[a + "kv_a_proj_with_mqa.weight"], hf["kv_lora_rank"]))
        out[sa + "kv_layernorm.weight"] = ("rep", hf_sd[a + "kv_a_layernorm.weight"])
        out[sa + "linear_kv_up_proj.weight"] = ("col", hf_sd[a + "kv_b_proj.weight"])
        out[sa + "linear_proj.weight"] = ("row", hf_sd[a + "o_proj.weight"])
        if L < dense:
            out[m + "mlp.linear_fc1.weight"] = ("gate_up", (hf_sd[p + "mlp.gate_proj.weight"],
                                                            hf_sd[p + "mlp.up_proj.weight"]))
            out[m + "mlp.linear_fc2.weight"] = ("row", hf_sd[p + "mlp.down_proj.weight"])
            continue
        out[m + "mlp.router.weight"] = ("rep", hf_sd[p + "mlp.gate.weight"])
        out[m + "mlp.router.expert_bias"] = ("rep", hf_sd[p + "mlp.gate.e_score_correction_bias"].float())
        out[m + "mlp.shared_experts.linear_fc1.weight"] = ("gate_up", (hf_sd[p + "mlp.shared_experts.gate_proj.weight"],
                                                                       hf_sd[p + "mlp.shared_experts.up_proj.weight"]))
        out[m + "mlp.shared_experts.linear_fc2.weight"] = ("row", hf_sd[p + "mlp.shared_experts.down_proj.weight"])
        for E in range(hf["n_routed_experts"]):
            e, me = f"{p}mlp.experts.{E}.", f"{m}mlp.experts.local_experts.{E}."
            out[me + "linear_fc1.weight"] = ("gate_up", (hf_sd[e + "gate_proj.weight"], hf_sd[e + "up_proj.weight"]))
            out[me + "linear_fc2.weight"] = ("row", hf_sd[e + "down_proj.weight"])
    return out


def shard(kind: str, t, rank: int, tp: int) -> torch.Tensor:
    if kind == "rep":
        return t
    if kind in ("col", "vocab"):
        return t.chunk(tp, dim=0)[rank]
    if kind == "row":
        return t.chunk(tp, dim=1)[rank]
    if kind == "gate_up":
        gate, up = t
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------
def run_rank(rank: int, world: int, args, port: int, result_q=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1 if world > 1 else 2)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.models.gpt import GPTModel
    from rlmega.megatron import cpu_support

    cpu_support.enable_cpu_execution()           # CUDA device requests -> CPU, CPU RNG tracker
    cpu_support.moe_without_transformer_engine()  # moe_utils.te_general_gemm = None (router NameError)
    patch_mla_without_te()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)

    hf_dir = Path(args.hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = mla_config(hf, args.tp, rotary_interleaved=args.rope_interleaved)
    if args.wrong == "no_group":
        cfg.moe_router_num_groups = cfg.moe_router_group_topk = None
    elif args.wrong == "yarn_as_rope":
        cfg = mla_config(dict(hf, rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base}), args.tp)
    elif args.wrong == "no_mscale_all_dim":
        cfg = mla_config(dict(hf, rope_parameters=dict(hf["rope_parameters"], mscale_all_dim=0.0)), args.tp)
    elif args.wrong == "no_scaling":
        cfg.moe_router_topk_scaling_factor = None
    padded_vocab = -(-hf["vocab_size"] // 128) * 128
    spec = layer_specs(cfg, stock=args.stock)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab,
                     max_sequence_length=hf["max_position_embeddings"], position_embedding_type="none",
                     share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    # MLA builds its own (rope or yarn) rotary embedding in every layer and asserts it is passed none;
    # GPTModel skips its own for multi_latent_attention (gpt_model.py:159), so "rope" or "none" is the same.
    model.eval()

    conv = hf_to_mcore(load_hf_state(hf_dir), dict(hf, rope_interleave=True) if args.wrong == "no_rope_permute" else hf,
                       padded_vocab)
    if args.wrong == "no_expert_bias":
        conv = {k: (kind, torch.zeros_like(t) if k.endswith("expert_bias") else t) for k, (kind, t) in conv.items()}
    sd = model.state_dict()
    want = {k for k in sd if not k.endswith("_extra_state")}
    missing, extra = want - set(conv), set(conv) - want
    assert not missing and not extra, f"missing {sorted(missing)[:8]} extra {sorted(extra)[:8]}"
    new = {k: shard(*conv[k], ps.get_tensor_model_parallel_rank(), args.tp) for k in want}
    for k in want:
        assert new[k].shape == sd[k].shape, (k, new[k].shape, sd[k].shape)
    model.load_state_dict(new, strict=False)

    tokens = make_tokens(hf["vocab_size"])
    B, S = tokens.shape
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    with torch.no_grad():
        logits = model(tokens, position_ids, attention_mask=None)  # (B, S, Vp/tp)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(logits)[..., : hf["vocab_size"]].float()
    if rank == 0:
        ref, hf_scale = hf_logits(hf_dir, tokens)
        attn = model.decoder.layers[0].self_attention
        print(f"softmax scale: megatron {attn.softmax_scale:.9f} (core_attention {attn.core_attention.softmax_scale:.9f})"
              f"  HF {hf_scale:.9f}")
        diff = (logits - ref).abs().max().item()
        print(f"[{hf_dir.name} wrong={args.wrong} rotary_interleaved={args.rope_interleaved}] TP{args.tp}: logits {tuple(logits.shape)}  max|ref| {ref.abs().max().item():.4f}  "
              f"max|diff| {diff:.3e}  argmax agree {(logits.argmax(-1) == ref.argmax(-1)).float().mean().item():.3f}")
        if result_q is not None:
            result_q.put(diff)
    dist.destroy_process_group()


def make_stress(src: Path, dst: Path, rope_interleave: bool = True, seed: int = 0,
                rope_parameters: dict | None = None) -> None:
    """A copy of the tiny model whose every part matters to the logits: transformers' init (std 0.02)
    leaves attention near-uniform (RoPE barely visible) and the router's sigmoid ~0.5 +- 0.005, so the
    0.1-scale e_score_correction_bias alone picks the same experts for every token. Here the linear
    weights are x5 (std ~0.1), the router x10, norms get 1 + 0.2*randn, and the bias stays."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                t.mul_(10.0)
            elif "embed" not in name:
                t.mul_(5.0)
    model.config.rope_interleave = rope_interleave
    if rope_parameters is not None:
        model.config.rope_parameters = rope_parameters
    model.save_pretrained(str(dst))


def make_tokens(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (2, 24), generator=g)


def stock_probe(args):
    """Build one MLA layer from the STOCK local spec and print what fails."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.models.gpt import GPTModel
    from rlmega.megatron import cpu_support
    cpu_support.enable_cpu_execution()
    cpu_support.moe_without_transformer_engine()
    if args.stock_te_flag:
        patch_mla_without_te()
    ps.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1234)
    hf = json.loads((HF_DIR / "config.json").read_text())
    cfg = mla_config(hf, 1)
    try:
        GPTModel(config=cfg, transformer_layer_spec=layer_specs(cfg, stock=True, dpa_fix=args.stock_dpa), vocab_size=128,
                 max_sequence_length=512, position_embedding_type="none")
        print("stock local spec: built")
    except Exception as e:  # the innermost message (build_module re-raises it wrapped, per level)
        print(f"stock local spec: {type(e).__name__}: {str(e).split(' when instantiating')[0]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--stock", action="store_true")
    ap.add_argument("--stock-te-flag", action="store_true", help="with --stock: apply only the HAVE_TE fix")
    ap.add_argument("--stock-dpa", action="store_true", help="with --stock: apply only the k_channels fix")
    ap.add_argument("--rope-interleaved", action="store_true",
                    help="set megatron rotary_interleaved=True (wrong for HF rope_interleave=True; for the report)")
    ap.add_argument("--port", type=int, default=29601)
    ap.add_argument("--hf-dir", default=str(HF_DIR))
    ap.add_argument("--make-stress", action="store_true",
                    help="write ROOT/hf_stress* (see make_stress)")
    ap.add_argument("--wrong", default=None, choices=["no_group", "no_scaling", "no_expert_bias", "yarn_as_rope", "no_mscale_all_dim",
                             "no_rope_permute"],
                    help="a deliberately wrong setting (negative control: the check must see it)")
    args = ap.parse_args()
    ensure_hf()
    if args.make_stress:
        make_stress(HF_DIR, ROOT / "hf_stress", rope_interleave=True)
        make_stress(HF_DIR, ROOT / "hf_stress_nointerleave", rope_interleave=False)
        # YaRN, original context 16 < the test's 24 tokens: mscale != mscale_all_dim so both the
        # cos/sin concentration factor and the softmax mscale^2 are != 1 ...
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)
        make_stress(HF_DIR, ROOT / "hf_stress_yarn", rope_parameters=yarn)
        # ... and DeepSeek-V3's own values (factor 40, mscale = mscale_all_dim = 1)
        make_stress(HF_DIR, ROOT / "hf_stress_yarn_v3", rope_parameters=dict(
            yarn, factor=40.0, mscale=1.0, mscale_all_dim=1.0))
        return
    if args.stock:
        return stock_probe(args)
    if args.tp == 1:
        run_rank(0, 1, args, args.port)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run_rank, args=(args.tp, args, args.port), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
