"""rollout.cache_dir reaches vLLM: engine_args sets VLLM_CACHE_ROOT (read by vLLM when it compiles, in the
engine's process and the engine core it spawns); unset, vLLM keeps its own default."""
import os

from rlmega.rollout.engine_lifecycle import engine_args
from rlmega.tiny_model import make_tiny_model


def _args(model, cache_dir):
    return engine_args(str(model), device="cpu", dtype="float32", max_model_len=96, seed=0, kv_cache_space_gb=1.0,
                       gpu_memory_utilization=0.5, tensor_parallel_size=1, enforce_eager=False,
                       enable_prefix_caching=False, profile_dir=None, attention_backend=None, cache_dir=cache_dir)


def test_cache_dir_becomes_vllm_cache_root_and_none_leaves_vllm_default(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=1, seed=0)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # engine_args sets it: restored after the test
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/somewhere/the/user/set")
    import vllm.envs as envs

    _args(model, None)
    assert envs.VLLM_CACHE_ROOT == "/somewhere/the/user/set"
    _args(model, str(tmp_path / "cache"))
    assert os.environ["VLLM_CACHE_ROOT"] == envs.VLLM_CACHE_ROOT == str(tmp_path / "cache")
