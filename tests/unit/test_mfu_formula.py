"""The model-FLOPs formula of tools/bench/megatron_mfu.py, computed by hand."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "megatron_mfu", Path(__file__).resolve().parents[2] / "tools" / "bench" / "megatron_mfu.py"
)
mfu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mfu)


def test_flops_per_token_by_hand():
    hf = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=10,
    )
    # q 4*2*2=16, k+v 2*4*1*2=16, o 16 -> 48; gate/up/down 3*4*8=96; two norms 8 -> 152 per layer;
    # + final norm 4 + head 10*4=40 -> N = 196. 6N = 1176; attention 12 * L * S * heads * head_dim = 12*1*3*4 = 144.
    assert mfu.counted_params(hf) == 196
    assert mfu.model_flops_per_token(hf, seq_len=3) == 1176 + 144
    # Qwen2 adds the q, k, v biases: 2*2 + 2*1*2 = 8.
    assert mfu.counted_params(dict(hf, architectures=["Qwen2ForCausalLM"])) == 204


def test_the_1b_shape_counts_llama_3_2_1b_published_parameters():
    # Llama-3.2-1B (tied embeddings) has 1,235,814,400 parameters; tied, the head is the embedding,
    # so N (no input-embedding lookup, head counted once) is exactly that.
    assert mfu.counted_params(mfu.LLAMA_1B) == 1_235_814_400
