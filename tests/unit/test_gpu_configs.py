"""The realistic GPU configs in configs/ load and validate against their models' real shapes.

The model folders live on a GPU cluster, so each test writes the model's config.json (the
published hyper-parameters) to a temporary folder and points model.path there.
"""
import json
from pathlib import Path

import pytest

from rlmega.config import load_config

ROOT = Path(__file__).resolve().parents[2]
QWEN2_7B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                num_hidden_layers=28, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=32, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False)


@pytest.mark.parametrize("name, hf", [("qwen2_7b_tp4pp2_2nodes.yaml", QWEN2_7B), ("llama3_8b_tp2pp2vpp2.yaml", LLAMA3_8B)])
def test_gpu_config_validates(tmp_path, name, hf):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "1+1="}], "prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config(ROOT / "configs" / name, [f"model.path={tmp_path}", f"data.train_path={data}",
                                                 f"data.eval_path={data}", f"trainer.run_dir={tmp_path / 'run'}"])
    p = cfg.parallelism
    assert p.world_size % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) == 0
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.device == "cuda"


def test_gpu_config_rejects_a_layout_the_model_cannot_take(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    with pytest.raises(ValueError, match="parallelism.tensor_model_parallel_size"):
        load_config(ROOT / "configs/qwen2_7b_tp4pp2_2nodes.yaml",
                    [f"model.path={tmp_path}", "parallelism.tensor_model_parallel_size=8",
                     "data.train_path=''", "data.eval_path=''"])
