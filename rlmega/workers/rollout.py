"""RolloutWorker: one vLLM engine that generates samples and takes new weights in place.

A plain class; Ray hosts it in ``rlmega/launch/``, tests drive it directly (in a fresh process each:
vLLM keeps process-wide state).

    worker = RolloutWorker("/path/to/hf_model", device="cpu", max_model_len=512, seed=0)
    samples = worker.generate([[1, 5, 7], [1, 9]], n=4, temperature=1.0, max_tokens=64)
    worker.update_weights(actor.export_hf_weights(), version=step)   # may be called per bucket
    worker.kv_cache_max_concurrency()                                 # e.g. 137.5
    worker.shutdown()

Log-probs: which ones vLLM returns, and why ``logprobs_mode="processed_logprobs"``
--------------------------------------------------------------------------------
The trainer scores a response with ``log_softmax(logits / temperature)`` over the real vocabulary.
vLLM 0.32's default, ``ModelConfig.logprobs_mode = "raw_logprobs"`` (vllm/config/model.py:287), is
``log_softmax(logits)`` taken *before* penalties and temperature: ``Sampler.forward`` computes it
first thing (vllm/v1/sample/sampler.py:88-89, "Use the original logits (before any penalties or
temperature scaling)"). At temperature != 1 that is not the distribution the token was drawn from,
nor what the trainer computes (measured on the tiny model at T=0.7: max |diff| 0.22, mean 0.08;
at T=1 the modes agree). With ``"processed_logprobs"`` the sampler instead returns ``log_softmax``
of the logits it actually samples from: after the logits processors and penalties, after
``apply_temperature`` (``logits.div_(temp)``, sampler.py:239) and after top-k/top-p
(``TopKTopPSampler.forward_cpu`` / ``forward_native``, vllm/v1/sample/ops/topk_topp_sampler.py:
328-333 and 274-279; it replaces the raw values at sampler.py:104; the GPU model runner V2 does the
same in vllm/v1/worker/gpu/sample/sampler.py:173-175). With the defaults this worker sends (no penalties, no logit bias, no min_p, min_tokens=0,
top_p=1, top_k off) the value for the sampled token is exactly ``log_softmax(logits / T)[token]``,
computed in float32 — the trainer's quantity (tests/e2e/test_rollout_worker.py checks it against
transformers at T=1.0 and T=0.7).

Caveats:
- top_p < 1 or top_k > 0: ``apply_top_k_top_p`` sets the dropped logits to -inf *before* the
  ``log_softmax``, so the processed log-probs are renormalised over the kept set: they are >= the
  trainer's full-vocabulary log-probs (equal only when nothing is dropped). ``generate`` warns.
  ("raw_logprobs" would not help: it ignores temperature too.) Either train with the same
  truncation, or treat the gap as an off-policy correction.
- temperature 0 (greedy): the log-probs are ``log_softmax(logits)`` (temperature treated as 1).
- On CUDA, processed modes turn off FlashInfer's fused top-k/top-p sampler (it cannot return
  processed logits), so sampling uses the PyTorch path: a small cost for correct log-probs.

Weights: ``update_weights`` streams HF-named tensors into the running engine through
``worker.model_runner.reload_weights`` (vllm/model_executor/model_loader/reload/). That path
restores each vLLM layer on the meta device, buffers what arrives and processes (repacks) a layer
once all its elements are loaded. A layer only *partly* present in one reload is materialised with
``torch.empty`` for the missing part (``finalize_layerwise_processing`` -> "Delayed processing",
``materialize_meta_tensor``): garbage. vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, and a layer's weight and bias load together, so a bucket boundary between
``q_proj.weight`` and ``k_proj.weight`` (or ``q_proj.weight`` and ``q_proj.bias``) would corrupt the
layer. So this worker holds back the tensors of every vLLM layer until all of its HF tensors have
arrived (across calls), and reloads only complete layers. Whole layers may come in any number of
calls in any order; ``generate`` refuses to run while a layer is incomplete. (Layers are found from
the vLLM model's parameter names and ``packed_modules_mapping``; a name that maps to no vLLM layer,
such as a tied ``lm_head.weight``, is passed straight to vLLM, which decides.)

One hazard seen on CPU: weights that make NaNs leave NaN in the KV-cache blocks they wrote, and
vLLM's CPU attention reads whole blocks, so the next generations after a fix may still be NaN until
those blocks are recycled. After a NaN incident, restart the engine rather than trust a reload.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import warnings
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

_GiB = 1 << 30


@dataclasses.dataclass
class Sample:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the list given to ``generate``."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """One per response token: log_softmax(logits / temperature)[sampled token] (see module doc)."""
    finish_reason: str
    """``"stop"`` (EOS or a stop token, kept as the last response token), ``"length"`` (max_tokens),
    or whatever else vLLM reports (``"abort"``)."""


class RolloutWorker:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int = 512, seed: int = 0, kv_cache_space_gb: float = 1.0,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 enforce_eager: bool = True, enable_prefix_caching: bool = False, profile_dir: str | None = None,
                 num_threads: int | None = None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: choose 'cpu' or 'cuda'")
        if num_threads is not None:  # before vLLM: its CPU worker forbids changing them afterwards
            torch.set_num_threads(num_threads)
        self.device, self.model_path, self.max_model_len = device, str(model_path), max_model_len
        self._version, self._tp = 0, tensor_parallel_size
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # vLLM layer -> HF name -> tensor

        # vLLM reads these when it is imported and when the engine starts, so set them first.
        # In-process engine core: collective_rpc then runs in this process, so update_weights
        # hands tensors over without serialising them.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine_kwargs: dict = {}
        if device == "cpu":
            # The env var holds whole GiB only (int() in vllm/envs.py and platforms/cpu.py) and wins
            # over kv_cache_memory_bytes; a fractional size therefore goes through the engine argument.
            if float(kv_cache_space_gb).is_integer():
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gb))
            else:
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * _GiB)
        else:
            engine_kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)

        if profile_dir:  # logging.profile_steps: vLLM's torch profiler, started per step (start_profile)
            from vllm.config import ProfilerConfig

            # No Python stacks (vLLM's default has them): ops and shapes, like the trainer ranks' traces;
            # stacks made one traced step's engine trace 16 MB and the step ~30 s slower here.
            engine_kwargs["profiler_config"] = ProfilerConfig(
                profiler="torch", torch_profiler_dir=os.path.abspath(profile_dir),
                torch_profiler_with_stack=False, torch_profiler_record_shapes=True)
        from vllm import LLM

        self._llm = LLM(
            model=self.model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the module doc
            # Off by default: a prefix-cache hit reuses KV computed in another batch, and exact
            # resume (same seeds, same weights -> same samples) must not depend on cache history.
            enable_prefix_caching=enable_prefix_caching,
            **engine_kwargs,
        )
        self.vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        self._layer_members = self._expected_hf_names_by_layer()

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 32, stop_token_ids: list[int] | None = None,
                 seed: int | None = None, ignore_eos: bool = False) -> list[Sample]:
        """Sample ``n`` responses per prompt (token ids in, token ids out), prompt-major order.

        ``seed`` makes the call reproducible: prompt i uses seed + i * n and vLLM gives its j-th
        sample seed + i * n + j, so no two samples share a random stream.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_no_pending()
        if top_p < 1.0 or top_k > 0:
            warnings.warn(
                f"top_p={top_p}, top_k={top_k}: vLLM's processed log-probs are renormalised over the "
                "kept tokens, so they are not the trainer's full-vocabulary log_softmax(logits / T)",
                stacklevel=2,
            )
        params = [
            SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                max_tokens=max_tokens, stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos,
                seed=None if seed is None else seed + i * n,
                logprobs=0,        # the sampled token's log-prob only
                detokenize=False,  # token ids in and out; stop strings are not used
            )
            for i in range(len(prompts))
        ]
        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        samples = []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                samples.append(Sample(
                    prompt_index=i, prompt_ids=list(prompts[i]), response_ids=ids,
                    # logprobs=0: one {token_id: Logprob} per position, holding the sampled token.
                    logprobs=[step[t].logprob for t, step in zip(ids, c.logprobs)],
                    finish_reason=str(c.finish_reason),
                ))
        return samples

    # ---- weights ----------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors in place; any iterable (a generator streams without a copy).

        A partial set is fine, and one call may end inside a fused vLLM layer: that layer's tensors
        wait here until the rest arrive in a later call (see the module doc). Prefix cache reset.
        """
        # TODO(gpu): vLLM's weight-transfer API (init_weight_transfer_engine / update_weights over
        # NCCL or CUDA IPC, vllm/distributed/weight_transfer/) avoids the host round trip on GPU.
        # reload_weights is correct on both devices, so it is the path for now.
        stream = self._complete_layers(iter(named_tensors))
        # One in-process worker consumes the generator directly (no copy, one layer buffered at a
        # time); TP > 1 workers live in other processes and need a picklable list.
        payload = stream if self._tp == 1 else list(stream)
        self._llm.collective_rpc(_reload_weights, args=(payload,))
        self._llm.reset_prefix_cache()
        self._version = version

    def start_profile(self, prefix: str) -> None:
        """Trace the engine until stop_profile (needs profile_dir); files are named ``prefix``_..."""
        self._llm.start_profile(prefix)

    def stop_profile(self) -> None:
        self._llm.stop_profile()

    def weight_version(self) -> int:
        return self._version

    def pending_weights(self) -> list[str]:
        """HF names held back because their vLLM layer is still incomplete."""
        return sorted(name for group in self._pending.values() for name in group)

    def _complete_layers(self, named_tensors: Iterator[tuple[str, torch.Tensor]]):
        for name, tensor in named_tensors:
            layer = self._layer_of(name)
            members = self._layer_members.get(layer)
            if members is None or len(members) == 1:  # unknown (tied lm_head, ...) or unfused: pass on
                yield name, tensor
                continue
            group = self._pending.setdefault(layer, {})
            group[name] = tensor
            if members <= group.keys():
                del self._pending[layer]
                yield from group.items()

    def _check_no_pending(self) -> None:
        if self._pending:
            names = self.pending_weights()
            raise RuntimeError(
                f"{len(names)} weights wait for the rest of their fused vLLM layer (e.g. {names[:4]}); "
                "send the missing q/k/v, gate/up or bias tensors with update_weights before generating"
            )

    def _expected_hf_names_by_layer(self) -> dict[str, set[str]]:
        """vLLM layer name -> the HF tensor names that fill it (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
        vllm_names, packed = self._llm.collective_rpc(_param_names_and_packing)[0]
        self._shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
        layers: dict[str, set[str]] = {}
        for name in vllm_names:
            module, _, param = name.rpartition(".")
            head, _, leaf = module.rpartition(".")
            shards = packed.get(leaf, [leaf])
            layers.setdefault(module, set()).update(
                f"{head + '.' if head else ''}{s}.{param}" for s in shards
            )
        return layers

    def _layer_of(self, hf_name: str) -> str:
        module = hf_name.rpartition(".")[0]
        head, _, leaf = module.rpartition(".")
        fused = self._shard_to_fused.get(leaf, leaf)
        return f"{head + '.' if head else ''}{fused}"

    # ---- capacity, memory, lifecycle --------------------------------------------------------
    def kv_cache_max_concurrency(self) -> float:
        """How many ``max_model_len``-token sequences fit in the KV cache at once.

        vLLM computes it when it sizes the KV cache (``get_max_concurrency_for_kv_cache_config`` in
        vllm/v1/core/kv_cache_utils.py: num_blocks / blocks per max_model_len request), logs it as
        "Maximum concurrency for N tokens per request" and stores it in
        ``cache_config.kv_cache_max_concurrency`` (``update_kv_cache_capacity``); with a separate
        engine-core process the client copies it back (vllm/v1/engine/core_client.py).
        """
        value = self._llm.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency
        if value is None:
            raise RuntimeError("vLLM did not record kv_cache_max_concurrency (KV cache not sized yet?)")
        return float(value)

    def sleep(self, level: int = 1) -> bool:
        """Free accelerator memory (1: offload weights, drop KV cache; 2: drop both).

        Sleep mode is CUDA-only (vLLM's CPU worker ignores it): on CPU this does nothing and returns
        False. After level 2, send the weights again with ``update_weights`` before generating.
        """
        if self.device != "cuda":
            return False
        self._llm.sleep(level=level)
        return True

    def wake_up(self) -> bool:
        if self.device != "cuda":
            return False
        self._llm.wake_up()
        self._llm.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Tear the engine down (engine core, executor, distributed groups) so another can start."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # teardown is best effort: report, never mask the caller's error
            logger.warning("vLLM engine shutdown raised %r", exc)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# Run on every vLLM worker through collective_rpc(fn, args): fn(worker, *args).
def _reload_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.reload_weights(weights_iterator=weights)


def _param_names_and_packing(worker) -> tuple[list[str], dict[str, list[str]]]:
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return [name for name, _ in model.named_parameters()], {k: list(v) for k, v in packed.items()}
