"""RolloutWorker: one vLLM engine that generates samples and takes new weights in place.

A plain class; Ray hosts it in ``rlmega/launch/`` as a threaded actor, tests drive it directly (in a
fresh process each: vLLM keeps process-wide state).

    worker = RolloutWorker("/path/to/hf_model", device="cpu", max_model_len=512, seed=0)
    samples = worker.generate([[1, 5, 7], [1, 9]], n=4, temperature=1.0, max_tokens=64)
    sample = worker.generate_one([1, 5, 7], max_tokens=64, seed=3, request_id="a")  # from any thread
    worker.abort("a")                       # from another thread: "a" returns what it has, "abort"
    worker.update_weights(actor.export_hf_weights(), version=step)   # may be called per bucket
    n = worker.pause_generation(abort_in_flight=True)   # a sync while requests are in flight:
    worker.update_weights(new_weights, version=step + 1)  # they resume on the new weights
    worker.resume_generation()
    worker.busy_seconds()                                             # for an engine busy fraction
    worker.kv_cache_max_concurrency()                                 # e.g. 137.5
    worker.shutdown()

The engine: vLLM's ``AsyncLLM``, on a private asyncio loop
---------------------------------------------------------
The worker owns an ``AsyncLLM`` whose event loop runs in a daemon thread started by ``__init__``.
Every public method is synchronous and thread-safe: it submits a coroutine to that loop
(``asyncio.run_coroutine_threadsafe``) and waits for its result. So a caller that is not async
(the tests, the driver) uses it as before, and a Ray actor with ``max_concurrency`` > 1 (one
thread per call) lets many callers' ``generate_one`` run at once: vLLM schedules whatever requests
are in flight together (continuous batching), whoever sent them. ``generate`` is ``n`` x prompts
such single requests, sent together.

Seeds: vLLM gives the j-th child of an ``n > 1`` request ``seed + j`` (``ParentRequest.
_get_child_sampling_params``, vllm/v1/engine/parallel_sampling.py) and a seeded request its own
generator, so prompt i sample j with seed ``seed + i * n + j`` is the same random stream as the
old ``LLM.generate(n=n)`` with seed ``seed + i * n`` gave it (tests/e2e/test_rollout_worker.py
checks token-for-token equality with outputs recorded from that code).

Processes: the engine core (scheduler and, on CPU and at TP 1 on GPU, the model) is a child process,
``VLLM::EngineCore``; at TP > 1 its model workers are its children. ``shutdown`` stops them all. They
also go when this process dies without it (SIGKILL, a Ray actor killed): vLLM's model workers watch
the engine core (a death pipe), but the engine core does not watch this process, and was left running
(measured), so a thread in it polls this process and kills it (``rlmega_watch_owner`` in
rlmega/workers/vllm_extension.py): within a second here, measured with ``ps``.

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

Weights: ``update_weights`` sends HF-named tensors into the running engine, one safetensors file in
shared memory per call, through ``collective_rpc`` into a method that vLLM mixes into its worker (the
``worker_extension_cls`` engine argument: rlmega/workers/vllm_extension.py). There they go to
``worker.model_runner.reload_weights`` (vllm/model_executor/model_loader/reload/). That path
restores each vLLM layer on the meta device, buffers what arrives and processes (repacks) a layer
once all its elements are loaded. A layer only *partly* present in one reload is materialised with
``torch.empty`` for the missing part (``finalize_layerwise_processing`` -> "Delayed processing",
``materialize_meta_tensor``): garbage. vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, and a layer's weight and bias load together, so a bucket boundary between
``q_proj.weight`` and ``k_proj.weight`` (or ``q_proj.weight`` and ``q_proj.bias``) would corrupt the
layer. So this worker holds back the tensors of every vLLM layer until all of its HF tensors have
arrived (across calls), and reloads only complete layers. Whole layers may come in any number of
calls in any order, from any number of threads at once (the held-back tensors sit behind a lock);
``generate`` refuses to run while a layer is incomplete. (Layers are found from
the vLLM model's parameter names and ``packed_modules_mapping``; a name that maps to no vLLM layer,
such as a tied ``lm_head.weight``, is passed straight to vLLM, which decides.)

In-flight weight syncs: ``pause_generation`` / ``resume_generation``
--------------------------------------------------------------------
An asynchronous pipeline syncs weights while requests are in flight. ``pause_generation`` closes a
gate: a request sent from then on waits (its call blocks, it does not fail) until
``resume_generation`` reopens it; ``update_weights`` works as ever in between. What happens to the
requests already in flight is the caller's choice:

- ``abort_in_flight=False`` ("finish"): they run to their end on the old weights; the pause
  returns once they all have.
- ``abort_in_flight=True`` ("abort", partial rollout): each is aborted in the engine, but its
  caller does not see that: the request waits at the gate, then goes on as a new engine request
  on prompt + tokens so far, with ``max_tokens`` less what it has, on the new weights. The caller
  gets one ``Sample``: ids, log-probs and ``token_versions`` of all parts end to end (each token
  keeps the version it was sampled with), the last part's finish reason, ``resumes`` counting the
  cuts. A continuation of a seeded request gets another seed (``_continuation``). vLLM matches stop
  strings on the text of one engine request, so a stop string begun before a cut and completed after
  it is matched here instead, once the part after the cut has ended (``_stop_across_cuts``): the
  response ends with the token that completes it, "stop", as an uncut request would (the tokens the
  part sampled after it are dropped). A part cut the moment it ended on its own keeps its own finish
  reason.

``abort(request_id)`` is the user's and always wins: such a request returns what it has, "abort",
and is never resumed (also when it was waiting at the gate). A request is one ``_Request`` in
``_live``; the gate, ``_live`` and the busy clock (``busy_seconds``: wall time with at least one
engine request running) are touched on the loop thread only, and a request checks the gate and
marks its part running with no ``await`` in between, so a pause sees every request either running
(and counts it) or waiting at the gate. One sync at a time: pauses do not nest.

Hosted as a threaded Ray actor, a request waiting at the gate holds the thread its call runs on. So
``generate`` and ``generate_one`` run in a Ray concurrency group of their own, ``GENERATION_GROUP``
(rlmega/launch/roles.py ``engine_actor_class``; callers send them with ``.options(concurrency_group=
GENERATION_GROUP)``, as rlmega/agents/router.py does), and everything else (weight buckets, pause,
resume, abort, versions) in the default group: however many requests wait at a paused gate, the
sync that reopens it always finds a thread.

MoE routes (routing replay from the rollout, R3): ``record_routes=True`` makes every ``Sample`` carry
``routed_experts``, the experts each token of prompt + response was routed to in the engine (see
``Sample.routed_experts`` for the -1 rows). vLLM's own ``enable_return_routed_experts`` needs Model
Runner V2 (Triton), which the CPU build lacks, so the worker extension captures them itself
(``rlmega_record_routes`` in rlmega/workers/vllm_extension.py) and each engine request's rows are taken
(and freed in the engine) when it ends (rlmega/workers/engine_routes.py); a cut request's parts are laid over one
another, the latest computation of each position winning. Each engine request gets an id of its own
(``<request_id>#<n>``), which is what ``abort`` and a pause abort in the engine. The capture is a Python
hook in the routers, which replayed CUDA graphs skip: ``record_routes`` needs ``enforce_eager=True``
(refused otherwise). Rows a finished part computed but did not get are warned about once per engine and
counted (``routes_missing``), never silently left -1.

One hazard seen on CPU: weights that make NaNs leave NaN in the KV-cache blocks they wrote, and
vLLM's CPU attention reads whole blocks, so the next generations after a fix may still be NaN until
those blocks are recycled. After a NaN incident, restart the engine rather than trust a reload.

CPU threads: the model computes in a process vLLM spawns, not here, and vLLM's CPU worker forbids
``torch.set_num_threads`` (vllm/v1/worker/cpu_worker.py). vLLM's own choice on CPU is a separate
model-worker process pinned by its executor (``VLLM_CPU_OMP_THREADS_BIND=auto``: one thread per
physical core of the first NUMA node, less one core kept for the engine core;
vllm/utils/ompmultiprocessing.py): one thread on a 2-core machine, and every engine of a node pinned
to the same cores. So ``num_threads`` reaches the model's process through the environment it is
spawned with: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (no pinning: trainer ranks take turns on the same
cores) and ``OMP_NUM_THREADS=num_threads``, which torch reads when the spawned process imports it.
Both are set only while the engine starts (a spawned process copies the environment then) and
restored after, so nothing else in this process changes. ``num_threads=None`` gives this process's
own torch thread count, as the in-process engine had. A ``VLLM_CPU_OMP_THREADS_BIND`` already in
the environment is the user's choice and is left alone. ``engine_threads()`` reports what the model
got. Without pinning, the separate model-worker process has no purpose, so on CPU the model runs in
the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, see ``__init__``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from rlmega.workers.engine_errors import engine_died
from rlmega.workers.engine_routes import EngineRoutes, fit_rows, start_recording
from rlmega.workers.vllm_extension import EXTENSION, stage_weights

# The Ray concurrency group of the generation calls when an actor hosts the worker (module doc).
GENERATION_GROUP = "generation"

logger = logging.getLogger(__name__)

_GiB = 1 << 30


@dataclasses.dataclass
class Sample:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the list given to ``generate`` (0 from ``generate_one``)."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """One per response token: log_softmax(logits / temperature)[sampled token] (see module doc)."""
    finish_reason: str
    """``"stop"`` (EOS, a stop token or a stop string, kept as the end of the response), ``"length"``
    (max_tokens), ``"abort"`` (``abort``: the tokens sampled until then), or whatever else vLLM reports."""
    weight_version: int = 0
    """The engine's weight version (``update_weights``) when the request started."""
    token_versions: list[int] = dataclasses.field(default_factory=list)
    """One per response token: the weight version it was sampled with. All ``weight_version``
    unless a weight sync cut the request and it resumed (``RolloutWorker.pause_generation``)."""
    resumes: int = 0
    """How many times a weight sync cut this request and it went on with the new weights."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay (``record_routes=True``): int16 (len(prompt_ids) + len(response_ids),
    num_moe_layers, topk), row j = the experts (model-global ids; MoE layers in model order) the
    engine's routers picked for token j of prompt + response. -1 rows where no route was recorded:
    the last response token (vLLM samples it but never feeds it back: no forward computes it),
    and prompt tokens a prefix-cache hit skipped (``enable_prefix_caching``). After a cut and resume
    each position keeps the route of its latest computation (the resumed part re-prefills prompt +
    tokens so far on the new weights: the final KV came from those routes). None when not recorded."""


class RolloutWorker:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int = 512, seed: int = 0, kv_cache_space_gb: float = 1.0,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 enforce_eager: bool = True, enable_prefix_caching: bool = False, profile_dir: str | None = None,
                 num_threads: int | None = None, record_routes: bool = False, attention_backend: str | None = None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: choose 'cpu' or 'cuda'")
        if record_routes and not enforce_eager:
            raise ValueError(
                "record_routes=True needs enforce_eager=True: replayed CUDA graphs never call the MoE routers' "
                "capture hook, so decoded tokens would have no recorded route (router_mismatch and rollout "
                "routing replay would be silently wrong). rlmega's engines (rlmega/launch/engines.py) run eager; "
                "fix: leave enforce_eager=True, or record_routes=False (algorithm.routing_replay=none on a dense "
                "model / actor.backend=fsdp)")
        self.device, self.model_path, self.max_model_len = device, str(model_path), max_model_len
        self._version, self._tp = 0, tensor_parallel_size
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # vLLM layer -> HF name -> tensor
        self._pending_lock = threading.Lock()  # buckets of one sync may arrive on several threads
        # Loop thread only (no lock): request id -> the requests holding it; the gate new engine
        # requests pass (cleared by pause_generation); the busy clock (engine requests running, and
        # since when at least one has, and the seconds of busy intervals already closed).
        self._live: dict[str, list[_Request]] = {}
        self._gate = asyncio.Event()
        self._gate.set()
        self._running, self._busy_since, self._busy_closed = 0, 0.0, 0.0
        self._ids = itertools.count()

        # vLLM reads these when it is imported and when the engine starts, so set them first.
        # AsyncLLM always runs its engine core in a child process. On CPU, "0" keeps the model in that
        # process too (the uniproc executor, as vLLM does on GPUs at TP 1); with "1" vLLM's CPU platform
        # starts one more process for it (platforms/cpu.py), only so that it can pin its threads, which
        # this worker turns off (see CPU threads in the module doc). Measured here: that process costs
        # ~6 s of CPU at every engine start (it imports torch and vLLM again) and 2 s more at shutdown.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if device == "cpu" else "1"
        engine_kwargs: dict = {}
        if device == "cpu":
            # The env var holds whole GiB only (int() in vllm/envs.py and platforms/cpu.py) and wins
            # over kv_cache_memory_bytes; a fractional size therefore goes through the engine argument.
            if float(kv_cache_space_gb).is_integer():
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gb))
            else:
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * _GiB)
            engine_kwargs.update(_whole_prefills(max_model_len))
        else:
            engine_kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)

        if attention_backend:  # vLLM's attention kernels by name (e.g. TRITON_ATTN); None: vLLM's choice
            engine_kwargs["attention_backend"] = attention_backend
        if profile_dir:  # logging.profile_steps: vLLM's torch profiler, started per step (start_profile)
            from vllm.config import ProfilerConfig

            # No Python stacks (vLLM's default has them): ops and shapes, like the trainer ranks' traces;
            # stacks made one traced step's engine trace 16 MB and the step ~30 s slower here.
            # ignore_frontend: the engine's trace only, not also one of this process's asyncio loop.
            engine_kwargs["profiler_config"] = ProfilerConfig(
                profiler="torch", torch_profiler_dir=os.path.abspath(profile_dir),
                torch_profiler_with_stack=False, torch_profiler_record_shapes=True, ignore_frontend=True)
        from vllm.engine.arg_utils import AsyncEngineArgs

        from rlmega.config.hf_support import architecture_overrides

        args = AsyncEngineArgs(
            model=self.model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the module doc
            # Off by default: a prefix-cache hit reuses KV computed in another batch, and exact
            # resume (same seeds, same weights -> same samples) must not depend on cache history.
            enable_prefix_caching=enable_prefix_caching,
            worker_extension_cls=EXTENSION,
            disable_log_stats=True,  # no periodic throughput lines in the logs
            hf_overrides=architecture_overrides(self.model_path),  # config.json with only model_type
            **engine_kwargs,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlmega-vllm-loop", daemon=True)
        self._thread.start()
        try:
            with _engine_threads(device, num_threads):
                self._engine = self._run(_start_engine(self, args))
            # Every process vLLM started goes when this one does, even by SIGKILL (module doc: Processes).
            self._run(self._engine.collective_rpc("rlmega_watch_owner", args=(os.getpid(),)))
            self.vocab_size = self._engine.model_config.get_vocab_size()
            self._layer_members = self._expected_hf_names_by_layer()
            # MoE routing replay: what the engine records for each Sample (rlmega/workers/engine_routes.py)
            self._routes: EngineRoutes | None = None
            if record_routes:
                self._routes = self._run(start_recording(self._engine))
                self.num_experts = self._routes.num_experts
        except BaseException:
            self.shutdown()
            raise


    def _run(self, coro):
        """Run ``coro`` on the engine's loop and wait for its result (from any thread but the loop's).

        A dead engine core raises ``EngineDied`` naming its root cause and log (engine_errors.py).
        """
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except EngineDeadError as e:
            raise engine_died(e) from e

    def _on_loop(self, fn):
        """``fn()`` on the engine's loop (where the gate, ``_live`` and the busy clock live)."""
        return self._run(_call(fn))

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 32, stop_token_ids: list[int] | None = None,
                 seed: int | None = None, ignore_eos: bool = False) -> list[Sample]:
        """Sample ``n`` responses per prompt (token ids in, token ids out), prompt-major order.

        ``seed`` makes the call reproducible: prompt i sample j uses seed + i * n + j, so no two
        samples share a random stream (and each gets the stream ``LLM.generate(n=n)`` gave it).
        """
        self._check_no_pending()
        _warn_truncation(top_p, top_k)
        base = f"gen{next(self._ids)}"

        async def all_samples():
            return await asyncio.gather(*[
                _generate(self, list(p), _params(temperature, top_p, top_k, max_tokens, stop_token_ids, None,
                                                None if seed is None else seed + i * n + j, ignore_eos),
                               f"{base}-{i}-{j}", prompt_index=i)
                for i, p in enumerate(prompts) for j in range(n)])

        return self._run(all_samples())

    def generate_one(self, prompt_ids: list[int], *, temperature: float = 1.0, top_p: float = 1.0,
                     top_k: int = -1, max_tokens: int = 32, stop_token_ids: list[int] | None = None,
                     stop: list[str] | None = None, seed: int | None = None, ignore_eos: bool = False,
                     request_id: str | None = None) -> Sample:
        """One response to one prompt; blocks this thread only (call it from many threads at once).

        ``stop``: stop strings; the response ends with the tokens that complete one (included), and
        only such a request pays for detokenizing. ``request_id`` (unique among requests in flight;
        one is made up when None) is what ``abort`` takes; requests may share one, as in vLLM, and an
        abort then ends them all.
        """
        self._check_no_pending()
        _warn_truncation(top_p, top_k)
        params = _params(temperature, top_p, top_k, max_tokens, stop_token_ids, stop, seed, ignore_eos)
        return self._run(_generate(self, list(prompt_ids), params, request_id or f"one{next(self._ids)}", 0))

    def abort(self, request_id: str) -> bool:
        """End a request in flight: its ``generate_one`` returns the tokens so far, ``"abort"``.

        Returns once the request has ended: True, or False if no such request was in flight.
        """
        return self._run(_abort(self, request_id))

    def num_outstanding(self) -> int:
        """Requests sent and not yet returned (also those waiting at a paused gate)."""
        return self._on_loop(lambda: sum(len(v) for v in self._live.values()))

    def pause_generation(self, abort_in_flight: bool) -> int:
        """Stop sending requests to the engine, for a weight sync; ``resume_generation`` undoes it.

        New requests wait (their calls block) until ``resume_generation``. The requests in flight:
        ``abort_in_flight=False``: run to their end on the current weights; returns, once they all
        have, how many there were. ``abort_in_flight=True``: are cut now and resume on the weights of
        resume time, from prompt + tokens so far with the tokens left (one ``Sample`` per request in
        the end; see the module doc); returns how many were cut (a request that ended on its own at
        that moment, or had no token left, just ends). A stop string spanning a cut ends the
        response where an uncut request would have ended (module doc).
        ``update_weights`` works while paused. One sync at a time: do not call it again before
        ``resume_generation``.
        """
        return self._run(_pause(self, abort_in_flight))

    def resume_generation(self) -> None:
        """Reopen the gate: waiting and cut requests go on (cut ones with the weights now loaded)."""
        self._on_loop(self._gate.set)

    def routes_missing(self) -> dict:
        """MoE route recording's misses: {"parts": engine requests lacking rows they computed, "rows": how
        many rows} (rlmega/workers/engine_routes.py); zeros when routes are not recorded."""
        r = self._routes
        return {"parts": 0 if r is None else r.missing_parts, "rows": 0 if r is None else r.missing_rows}

    def busy_seconds(self) -> float:
        """Wall seconds (monotonic) since the engine started with at least one engine request running.

        Requests waiting at a paused gate do not count. Divide by wall time for a busy fraction.
        """
        return self._on_loop(lambda: self._busy_closed + (time.monotonic() - self._busy_since
                                                          if self._running else 0.0))

    def _count_running(self, delta: int) -> None:
        """One engine request more (+1) or less (-1) running; opens and closes busy intervals (loop only)."""
        if self._running == 0 and delta > 0:
            self._busy_since = time.monotonic()
        self._running += delta
        if self._running == 0:
            self._busy_closed += time.monotonic() - self._busy_since


    # ---- weights ----------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors in place (any iterable); thread-safe, buckets in any order.

        A partial set is fine, and one call may end inside a fused vLLM layer: that layer's tensors
        wait here until the rest arrive in a later call (see the module doc). Prefix cache reset.
        """
        # TODO(gpu): vLLM's weight-transfer API (init_weight_transfer_engine / update_weights over
        # NCCL or CUDA IPC, vllm/distributed/weight_transfer/) avoids the host round trip on GPU.
        # reload_weights is correct on both devices, so it is the path for now.
        named_tensors = list(named_tensors)  # a generator is read outside the lock
        with self._pending_lock:
            ready = list(self._complete_layers(iter(named_tensors)))
        if ready:
            path = stage_weights(ready)  # a file in shared memory: see rlmega/workers/vllm_extension.py
            try:
                self._run(self._engine.collective_rpc("rlmega_reload_weights", args=(path,)))
            finally:
                os.unlink(path)
            self._run(self._engine.reset_prefix_cache())
        self._version = version

    def start_profile(self, prefix: str) -> None:
        """Trace the engine until stop_profile (needs profile_dir); files are named ``prefix``_..."""
        self._run(self._engine.start_profile(prefix))

    def stop_profile(self) -> None:
        self._run(self._engine.stop_profile())

    def weight_version(self) -> int:
        return self._version

    def pending_weights(self) -> list[str]:
        """HF names held back because their vLLM layer is still incomplete."""
        with self._pending_lock:
            return sorted(name for group in self._pending.values() for name in group)

    def _complete_layers(self, named_tensors: Iterator[tuple[str, torch.Tensor]]):
        """Pass through whole vLLM layers only (the caller holds ``_pending_lock``)."""
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
        names = self.pending_weights()
        if names:
            raise RuntimeError(
                f"{len(names)} weights wait for the rest of their fused vLLM layer (e.g. {names[:4]}); "
                "send the missing q/k/v, gate/up, expert or bias tensors with update_weights before generating"
            )

    def _expected_hf_names_by_layer(self) -> dict[str, set[str]]:
        """vLLM layer name -> the HF tensor names that fill it (q/k/v -> qkv_proj, gate/up -> gate_up_proj,
        and for a MoE layer every expert's gate/up/down -> ``<mlp>.experts.routed_experts``).

        An MoE layer's experts are one vLLM module holding two fused parameters (w13_weight: all
        experts' gate and up, w2_weight: their down), filled from E x 3 HF tensors
        (``model.layers.L.mlp.experts.E.gate_proj.weight`` ...; ``rlmega_expert_layers``): its
        processing after a reload (the CPU kernel's packing) needs all of them, so it is held back
        until every expert has arrived, like q/k/v. The router (``mlp.gate.weight``) is a plain layer.
        """
        vllm_names, packed = self._run(self._engine.collective_rpc("rlmega_param_names_and_packing"))[0]
        experts = self._run(self._engine.collective_rpc("rlmega_expert_layers"))[0]
        self._shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
        self._expert_layer = {n: module for module, names in experts.items() for n in names}
        layers: dict[str, set[str]] = {}
        for name in vllm_names:
            module, _, param = name.rpartition(".")
            if module in experts:
                layers[module] = set(experts[module])
                continue
            head, _, leaf = module.rpartition(".")
            shards = packed.get(leaf, [leaf])
            layers.setdefault(module, set()).update(
                f"{head + '.' if head else ''}{s}.{param}" for s in shards
            )
        return layers

    def _layer_of(self, hf_name: str) -> str:
        if hf_name in self._expert_layer:
            return self._expert_layer[hf_name]
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
        ``cache_config.kv_cache_max_concurrency`` (``update_kv_cache_capacity``); the engine core is a
        separate process, and the client copies it back (vllm/v1/engine/core_client.py).
        """
        value = self._engine.vllm_config.cache_config.kv_cache_max_concurrency
        if value is None:
            raise RuntimeError("vLLM did not record kv_cache_max_concurrency (KV cache not sized yet?)")
        return float(value)

    def engine_threads(self) -> list[int]:
        """Intra-op threads of each vLLM model worker (what ``num_threads`` set; see the module doc)."""
        return self._run(self._engine.collective_rpc("rlmega_num_threads"))

    def sleep(self, level: int = 1) -> bool:
        """Free accelerator memory (1: offload weights, drop KV cache; 2: drop both).

        Sleep mode is CUDA-only (vLLM's CPU worker ignores it): on CPU this does nothing and returns
        False. After level 2, send the weights again with ``update_weights`` before generating.
        """
        if self.device != "cuda":
            return False
        self._run(self._engine.sleep(level=level))
        return True

    def wake_up(self) -> bool:
        if self.device != "cuda":
            return False
        self._run(self._engine.wake_up())
        self._run(self._engine.reset_prefix_cache())
        return True

    def shutdown(self) -> None:
        """Stop the engine core and its model workers (child processes) and the loop thread.

        Without it (an actor killed with SIGKILL) the children still go: see the module doc.
        """
        engine, self._engine = getattr(self, "_engine", None), None
        loop = getattr(self, "_loop", None)
        if engine is not None:
            try:  # on the loop: AsyncLLM cancels its output handler there
                self._run(_shutdown_engine(engine))
            except Exception as exc:  # teardown is best effort: report, never mask the caller's error
                logger.warning("vLLM engine shutdown raised %r", exc)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                loop.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# The worker's coroutines live outside the class on purpose: Ray makes any actor class with an
# ``async def`` method an asyncio actor, whose sync methods then run one at a time on its event loop, so
# concurrent generate_one calls would be served one after another (measured: 64 requests of 128 tokens
# took 25.3 s instead of 1.2 s). Without one, the engine is a threaded actor (max_concurrency) as meant.
async def _start_engine(self, args):
    """Runs on the loop, so AsyncLLM starts its output handler there."""
    from vllm.v1.engine.async_llm import AsyncLLM

    config = args.create_engine_config()
    if self._tp > 1 and config.parallel_config.distributed_executor_backend == "ray":
        # vLLM chose its Ray executor because this actor runs in a placement group, but the engine
        # core that starts that executor is a child process, not a Ray worker, and cannot see the
        # group itself: hand it over, so that vLLM's workers go into this slot's bundles.
        # TODO(gpu): not yet run on a TP > 1 GPU engine.
        from ray.util import get_current_placement_group

        config.parallel_config.placement_group = get_current_placement_group()
    return AsyncLLM.from_vllm_config(config, disable_log_stats=True)


class _Request:
    """One ``generate``/``generate_one`` request while the worker holds it (loop thread only)."""

    def __init__(self):
        self.part: asyncio.Event | None = None  # the engine request now or last running; set once ended
        self.engine_id: str | None = None  # that engine request's id: the caller's id + "#<n>", unique
        self.preempted = False  # pause_generation(abort_in_flight=True) aborted that engine request
        self.cut = False        # ... and this request goes on after the pause (known when ``part`` is set)
        self.aborted = asyncio.Event()  # abort(): end with what it has, never resume
        self.done = asyncio.Event()     # returned to its caller


async def _generate(self, prompt_ids: list[int], params, request_id: str, prompt_index: int) -> Sample:
    from vllm.inputs import TokensPrompt

    req = _Request()
    self._live.setdefault(request_id, []).append(req)
    ids, logprobs, versions, cuts = [], [], [], []  # cuts: len(ids) at each cut
    reason, first_version, resumes, part_params = "abort", None, 0, params
    routes = None if self._routes is None else self._routes.empty()
    try:
        # One engine request per part: a pause with abort_in_flight cuts the part running, and the
        # next continues from prompt + tokens so far (module doc: In-flight weight syncs). From the
        # gate check to req.part there is no await, so a pause sees this request running or waiting.
        while await _wait_for_gate(self, req):  # False: abort() ended it while it waited
            if req.cut:
                resumes += 1
                part_params = _continuation(params, len(ids), resumes)
            version = self._version
            first_version = version if first_version is None else first_version
            req.part, req.preempted, req.cut = asyncio.Event(), False, False
            # Each engine request gets an id of its own (abort and the routes address that part alone;
            # callers may share a request id).
            req.engine_id = f"{request_id}#{next(self._ids)}"
            self._count_running(+1)
            try:
                final = None
                try:
                    async for out in self._engine.generate(TokensPrompt(prompt_token_ids=prompt_ids + ids),
                                                           part_params, req.engine_id):
                        final = out  # FINAL_ONLY: the one output, when the part has ended
                finally:
                    if routes is not None:  # taken even from a failed part: the engine frees them
                        # positions it surely computed: its last input token and each sampled token but the last
                        p0, n = len(prompt_ids) + len(ids), 0 if final is None else len(final.outputs[0].token_ids)
                        routes = await self._routes.take(self._engine, req.engine_id, routes,
                                                         must_have=range(p0 - 1, p0 + n - 1) if n else range(0))
                c = final.outputs[0]
                new = list(c.token_ids)
                ids += new
                # logprobs=0: one {token_id: Logprob} per position, holding the sampled token.
                logprobs += [step[t].logprob for t, step in zip(new, c.logprobs or [])]
                versions += [version] * len(new)
                reason = str(c.finish_reason)
                # Aborted by a pause, not by abort(), nor ended on its own as the abort came: go on,
                # unless no token is left to sample (max_tokens, or the model's length: vLLM's own cap).
                if reason == "abort" and req.preempted and not req.aborted.is_set():
                    if len(ids) >= params.max_tokens or len(prompt_ids) + len(ids) >= self.max_model_len:
                        reason = "length"
                    else:
                        req.cut = True
                if cuts and params.stop:  # a stop string across an earlier cut ends the response there
                    end = _stop_across_cuts(self._engine.tokenizer, ids, cuts, params.stop,
                                            params.skip_special_tokens)
                    if end is not None:
                        del ids[end:], logprobs[end:], versions[end:]
                        # (routes: cut to prompt + response below)
                        reason, req.cut = "stop", False
                if req.cut:
                    cuts.append(len(ids))
            finally:
                self._count_running(-1)
                req.part.set()  # pause_generation reads req.cut once this is set
            if not req.cut:
                break
    finally:
        live = self._live[request_id]
        live.remove(req)
        if not live:
            del self._live[request_id]
        req.done.set()
    return Sample(
        prompt_index=prompt_index, prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs,
        finish_reason=reason, weight_version=self._version if first_version is None else first_version,
        token_versions=versions, resumes=resumes,
        routed_experts=None if routes is None else fit_rows(routes, len(prompt_ids) + len(ids)),
    )


async def _wait_for_gate(self, req: _Request) -> bool:
    """Until the gate is open (at once if it is: no await); False if abort() ended ``req`` meanwhile."""
    while not self._gate.is_set() and not req.aborted.is_set():
        waits = [asyncio.ensure_future(self._gate.wait()), asyncio.ensure_future(req.aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return not req.aborted.is_set()


def _stop_across_cuts(tokenizer, ids: list[int], cuts: list[int], stop: list[str],
                      skip_special_tokens: bool) -> int | None:
    """Length of ``ids`` up to the token that first completes a stop string spanning one of ``cuts``
    (positions in ``ids`` where a request was cut and resumed), or None.

    Each engine request's own stop strings vLLM has matched; one spanning a cut ends within the
    longest stop string's length after it, so the text is decoded token by token from the cut until
    that many characters past it, and checked as vLLM's detokenizer checks each new token's text
    (``check_stop_strings``, include_stop_str_in_output as ``_params`` asks). A match found there
    wholly after the cut is one vLLM ended that part on: the same end.
    """
    from vllm.v1.engine.detokenizer import check_stop_strings

    longest, first = max(map(len, stop)), None
    for cut in cuts:
        before = prev = tokenizer.decode(ids[:cut], skip_special_tokens=skip_special_tokens)
        for end in range(cut + 1, len(ids) + 1 if first is None else min(first, len(ids) + 1)):
            text = tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
            if check_stop_strings(text, len(text) - len(prev), stop, True) is not None:
                first = end
                break
            if len(text) - len(before) >= longest:  # any later match lies wholly after the cut
                break
            prev = text
    return first


def _continuation(params, sampled: int, resumes: int):
    """SamplingParams of a cut request's next part: the tokens left, and another seed if seeded."""
    params = params.clone()
    params.max_tokens -= sampled
    if params.seed is not None:
        # vLLM gives a seeded request its own generator: with the same seed the continuation would draw
        # the very random numbers the first part drew for its first tokens, samples correlated with
        # that part's instead of fresh ones. A large prime step keeps the new seed away from those of
        # the neighbouring requests (generate seeds them seed + i * n + j).
        params.seed = (params.seed + resumes * _RESUME_SEED_STEP) % 2**31
    return params


_RESUME_SEED_STEP = 1_000_000_007  # a prime


async def _pause(self, abort_in_flight: bool) -> int:
    self._gate.clear()  # from here no engine request starts: new and cut requests wait at the gate
    running = [(req.engine_id, req, req.part) for reqs in self._live.values() for req in reqs
               if req.part is not None and not req.part.is_set()]
    if not abort_in_flight:
        await asyncio.gather(*[part.wait() for _, _, part in running])
        return len(running)
    for _, req, _ in running:
        req.preempted = True
    # As in _abort: an engine request still being registered misses an abort, so abort again.
    while not all(part.is_set() for _, _, part in running):
        await self._engine.abort(list({rid for rid, _, part in running if not part.is_set()}))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*[part.wait() for _, _, part in running]), timeout=0.05)
    return sum(req.cut for _, req, _ in running)


async def _abort(self, request_id: str) -> bool:
    ending = list(self._live.get(request_id, []))
    if not ending:
        return False
    for req in ending:
        req.aborted.set()  # never resumed; one waiting at the gate returns at once
    # A request still being registered by AsyncLLM.generate (an await before the engine knows
    # it) misses an abort, so abort again until each has ended.
    while not all(req.done.is_set() for req in ending):
        await self._engine.abort([req.engine_id for req in ending if req.engine_id is not None])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*[req.done.wait() for req in ending]), timeout=0.05)
    return True


async def _call(fn):
    return fn()


async def _shutdown_engine(engine) -> None:
    engine.shutdown()


def _whole_prefills(max_model_len: int) -> dict:
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


def _params(temperature, top_p, top_k, max_tokens, stop_token_ids, stop, seed, ignore_eos):
    """SamplingParams for one response (n=1) whose log-probs are the sampled tokens' own."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
        max_tokens=max_tokens, stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos, seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        # Token ids in and out; stop strings are matched on text, so only then detokenize.
        stop=list(stop or []), detokenize=bool(stop), include_stop_str_in_output=bool(stop),
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, as LLM.generate asks
    )


def _warn_truncation(top_p: float, top_k: int) -> None:
    if top_p < 1.0 or top_k > 0:
        warnings.warn(
            f"top_p={top_p}, top_k={top_k}: vLLM's processed log-probs are renormalised over the "
            "kept tokens, so they are not the trainer's full-vocabulary log_softmax(logits / T)",
            stacklevel=3,
        )


@contextlib.contextmanager
def _engine_threads(device: str, num_threads: int | None):
    """The environment vLLM's model worker is spawned with, for its thread count (see the module doc)."""
    env: dict[str, str] = {}
    if device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": str(num_threads or torch.get_num_threads())}
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
