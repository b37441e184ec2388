"""What engine_args hands vLLM. rollout.cache_dir: VLLM_CACHE_ROOT (read by vLLM when it compiles, in the engine's
process and the engine core it spawns); unset, vLLM keeps its own default. The CUDA-graph cap
(rollout.cuda_graph_max_batch, rlmega/config/engine_mode.py): vLLM's own config holds it."""

import os

from rlmega.rollout.engine_lifecycle import engine_args
from rlmega.demo.tiny_model import make_tiny_model


def _args(model, cache_dir, **kw):
    kw = {"enforce_eager": False, **kw}
    return engine_args(
        str(model),
        device="cpu",
        dtype="float32",
        max_model_len=96,
        seed=0,
        kv_cache_space_gb=1.0,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        enable_prefix_caching=False,
        profile_dir=None,
        attention_backend=None,
        cache_dir=cache_dir,
        **kw,
    )


def test_cache_dir_becomes_vllm_cache_root_and_none_leaves_vllm_default(tmp_path, monkeypatch):
    model = make_tiny_model(
        tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=1, seed=0
    )
    # engine_args sets it: restored after the test
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/somewhere/the/user/set")
    import vllm.envs as envs

    _args(model, None)
    assert envs.VLLM_CACHE_ROOT == "/somewhere/the/user/set"
    _args(model, str(tmp_path / "cache"))
    assert os.environ["VLLM_CACHE_ROOT"] == envs.VLLM_CACHE_ROOT == str(tmp_path / "cache")


def test_the_cuda_graph_cap_reaches_vllms_compilation_config(tmp_path, monkeypatch):
    """A compiled engine's config holds the cap under vLLM's own field name (a wrong name fails here, not at a GPU
    engine's start); an eager engine is given none. On CPU vLLM captures no graphs either way (mode NONE)."""
    model = make_tiny_model(
        tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=1, seed=0
    )
    # engine_args sets it: restored after the test
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    config = _args(model, None, cuda_graph_max_batch=24).create_engine_config()
    assert config.compilation_config.max_cudagraph_capture_size == 24
    eager = _args(model, None, enforce_eager=True, cuda_graph_max_batch=24).compilation_config
    assert (
        eager.get("max_cudagraph_capture_size")
        if isinstance(eager, dict)
        else eager.max_cudagraph_capture_size
    ) is None
