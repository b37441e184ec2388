"""RolloutWorker: one vLLM engine that generates samples and takes new weights in place.

A plain class; Ray hosts it in ``rlmega/launch/`` as a threaded actor, tests drive it directly (in a
fresh process each: vLLM keeps process-wide state).

    worker = RolloutWorker("/path/to/hf_model", device="cpu", max_model_len=512, seed=0)
    samples = worker.generate([[1, 5, 7], [1, 9]], n=4, temperature=1.0, max_tokens=64)
    sample = worker.generate_one([1, 5, 7], max_tokens=64, seed=3, request_id="a")  # from any thread
    worker.abort("a")                       # from another thread: "a" returns what it has, "abort"
    worker.update_weights(actor.export_hf_weights(), version=step)   # loaded when it returns
    worker.load_adapter(actor.adapter_for_rollout(), version=step)    # LoRA served unmerged (lora_rank > 0)
    worker.begin_weights(version=step, sender=key, nbytes_hint=0)  # a sync's start (its reload opens)
    worker.receive_weights(bucket, version=step, sender=key)   # a sync's buckets (transports), then
    worker.finish_weights(version=step, sender=key)            # one reload in the engine for them all
    n = worker.pause_generation(abort_in_flight=True)   # a sync while requests are in flight:
    worker.update_weights(new_weights, version=step + 1)  # they resume on the new weights
    worker.resume_generation()
    worker.busy_seconds()                                             # for an engine busy fraction
    worker.kv_cache_max_concurrency()                                 # e.g. 137.5
    worker.shutdown()

The worker owns an ``AsyncLLM`` whose event loop runs in a daemon thread; every public method is
synchronous and thread-safe (it runs a coroutine on that loop and waits), so a Ray actor with
``max_concurrency`` > 1 serves many callers' requests at once (vLLM batches them). Its parts:

    rlmega/rollout/engine_lifecycle.py   engine arguments, start, shutdown, the model's CPU threads
    rlmega/rollout/generation.py         Sample, requests, the pause gate, partial-rollout continuation
    rlmega/sync/fused_layers.py          holding back a fused vLLM layer until all its tensors came
    rlmega/rollout/weight_stream.py      one reload per weight sync (rlmega/sync/bucket_files.py: the
                                         files; vllm_extension.py: the engine's side)
    rlmega/rollout/engine_routes.py      MoE routes per sample (R3)

How and why (seeds, processes, log-probs, weights, in-flight syncs, routes, CPU threads):
docs/rollout_engine.md.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable

import torch

from rlmega.process.heap import imports_uncollected
from rlmega.sync import collective
from rlmega.sync.fused_layers import FusedLayers
from rlmega.sync.pieces import Piece
from rlmega.rollout.engine_errors import engine_died, engine_start_failed
from rlmega.rollout.engine_lifecycle import (
    engine_args,
    engine_threads,
    shutdown_engine,
    start_engine,
)
from rlmega.rollout.engine_routes import EngineRoutes, start_recording
from rlmega.rollout import generation, lora_serving
from rlmega.rollout.generation import Sample
from rlmega.rollout.weight_stream import WeightStream

# The Ray concurrency group of the generation calls when an actor hosts the worker: a request waiting
# at a paused gate holds its thread, so weight syncs, pause and resume go to the default group and
# always find a thread (rlmega/launch/roles.py engine_actor_class; rlmega/agents/router.py).
GENERATION_GROUP = "generation"

__all__ = ["GENERATION_GROUP", "RolloutWorker", "Sample"]

logger = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int = 512,
        seed: int = 0,
        kv_cache_space_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = False,
        profile_dir: str | None = None,
        num_threads: int | None = None,
        record_routes: bool = False,
        attention_backend: str | None = None,
        lora_rank: int = 0,
        images_per_prompt: int = 0,
        cache_dir: str | None = None,
        cuda_graph_max_batch: int | None = None,
    ):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: choose 'cpu' or 'cuda'")
        if record_routes and not enforce_eager:
            raise ValueError(
                "record_routes=True needs enforce_eager=True: replayed CUDA graphs never call the MoE routers' "
                "capture hook, so decoded tokens would have no recorded route (router_mismatch and rollout "
                "routing replay would be silently wrong). rlmega's engines run eager whenever they record routes "
                "(rlmega/config/engine_mode.py); "
                "fix: leave enforce_eager=True, or record_routes=False (algorithm.routing_replay=none on a dense "
                "model / actor.backend=fsdp)"
            )
        self.device, self.model_path, self.max_model_len = device, str(model_path), max_model_len
        self._version, self._tp = 0, tensor_parallel_size
        # Loop thread only (no lock): request id -> the requests holding it; the gate new engine
        # requests pass (cleared by pause_generation); the busy clock (engine requests running, and
        # since when at least one has, and the seconds of busy intervals already closed).
        self._live: dict = {}
        self._gate = asyncio.Event()
        self._gate.set()
        self._running, self._busy_since, self._busy_closed = 0, 0.0, 0.0
        self._ids = itertools.count()
        # LoRA served unmerged (lora_rank > 0): the adapter every request generates with, once one is loaded
        self.lora_rank, self._lora = lora_rank, None
        self._lora_dir: str | None = None
        # vLLM's imports, the engine actor's start, without collections (rlmega/process/heap.py); the heap is frozen
        # only for the fork of the engine core (engine_lifecycle.forked_engine_core)
        with imports_uncollected(freeze=False):
            args = engine_args(
                self.model_path,
                device=device,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                kv_cache_space_gb=kv_cache_space_gb,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                profile_dir=profile_dir,
                attention_backend=attention_backend,
                lora_rank=lora_rank,
                images_per_prompt=images_per_prompt,
                cache_dir=cache_dir,
                cuda_graph_max_batch=cuda_graph_max_batch,
            )
            # vLLM's engine modules are imported here, in this thread, before the loop thread starts: it then
            # only looks them up. Two threads importing vLLM's packages at once (the loop in start_engine, this
            # one in _result) were the one difference in the start-ups that failed on an installed module
            # ("No module named vllm.logprobs", twice in ~30 runs, issue 57).
            import vllm.v1.engine.async_llm  # noqa: F401
            import vllm.v1.engine.exceptions  # noqa: F401

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rlmega-vllm-loop", daemon=True
        )
        self._thread.start()
        try:
            with engine_threads(device, num_threads):
                self._engine = self._run(start_engine(args, tensor_parallel_size))
            # Every process vLLM started goes when this one does, even by SIGKILL (docs/rollout_engine.md).
            self._run(self._engine.collective_rpc("rlmega_watch_owner", args=(os.getpid(),)))
            self.vocab_size = self._engine.model_config.get_vocab_size()
            vllm_names, packed = self._run(
                self._engine.collective_rpc("rlmega_param_names_and_packing")
            )[0]
            experts = self._run(self._engine.collective_rpc("rlmega_expert_layers"))[0]
            self._layer_args = (vllm_names, packed, experts)
            self._layers = FusedLayers(*self._layer_args)
            ranks = self._run(self._engine.collective_rpc("rlmega_rank"))
            self._weights = WeightStream(self, self._layers, ranks)
            # MoE routing replay: what the engine records for each Sample (rlmega/rollout/engine_routes.py)
            self._routes: EngineRoutes | None = None
            if record_routes:
                self._routes = self._run(start_recording(self._engine))
                self.num_experts = self._routes.num_experts
        # named by its root cause and log: the driver shows the last line of this
        except Exception as e:
            self.shutdown()
            raise engine_start_failed(e) from e
        except BaseException:
            self.shutdown()
            raise

    def _run(self, coro):
        """Run ``coro`` on the engine's loop and wait for its result (from any thread but the loop's).

        A dead engine core raises ``EngineDied`` naming its root cause and log (engine_errors.py).
        """
        return self._result(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _result(self, future):
        """The result of a coroutine already sent to the loop (``_run``'s errors)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return future.result()
        except EngineDeadError as e:
            raise engine_died(e) from e

    def _on_loop(self, fn):
        """``fn()`` on the engine's loop (where the gate, ``_live`` and the busy clock live)."""
        return self._run(_call(fn))

    # ---- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 32,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        images: list[list[bytes] | None] | None = None,
    ) -> list[Sample]:
        """Sample ``n`` responses per prompt (token ids in, token ids out), prompt-major order.

        ``seed`` makes the call reproducible: prompt i sample j uses seed + i * n + j, so no two
        samples share a random stream (and each gets the stream ``LLM.generate(n=n)`` gave it).
        ``images``: per prompt, its images (encoded files) for a vision-language model, or None; such a prompt's
        ids hold one image placeholder per image, which the engine expands (``generation.generate_request``).
        """
        self._weights.check_ready()
        generation.warn_truncation(top_p, top_k)
        base = f"gen{next(self._ids)}"

        async def all_samples():
            return await asyncio.gather(
                *[
                    generation.generate_request(
                        self,
                        list(p),
                        generation.sampling_params(
                            temperature,
                            top_p,
                            top_k,
                            max_tokens,
                            stop_token_ids,
                            None,
                            None if seed is None else seed + i * n + j,
                            ignore_eos,
                        ),
                        f"{base}-{i}-{j}",
                        prompt_index=i,
                        images=images[i] if images else None,
                    )
                    for i, p in enumerate(prompts)
                    for j in range(n)
                ]
            )

        return self._run(all_samples())

    def generate_one(
        self,
        prompt_ids: list[int],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int = 32,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        images: list[bytes] | None = None,
    ) -> Sample:
        """One response to one prompt; blocks this thread only (call it from many threads at once).

        ``stop``: stop strings; the response ends with the tokens that complete one (included), and
        only such a request pays for detokenizing. ``request_id`` (unique among requests in flight;
        one is made up when None) is what ``abort`` takes; requests may share one, as in vLLM, and an
        abort then ends them all.
        """
        self._weights.check_ready()
        generation.warn_truncation(top_p, top_k)
        params = generation.sampling_params(
            temperature, top_p, top_k, max_tokens, stop_token_ids, stop, seed, ignore_eos
        )
        return self._run(
            generation.generate_request(
                self,
                list(prompt_ids),
                params,
                request_id or f"one{next(self._ids)}",
                0,
                images=images,
            )
        )

    def abort(self, request_id: str) -> bool:
        """End a request in flight: its ``generate_one`` returns the tokens so far, ``"abort"``.

        Returns once the request has ended: True, or False if no such request was in flight.
        """
        return self._run(generation.abort(self, request_id))

    def num_outstanding(self) -> int:
        """Requests sent and not yet returned (also those waiting at a paused gate)."""
        return self._on_loop(lambda: sum(len(v) for v in self._live.values()))

    def pause_generation(self, abort_in_flight: bool) -> int:
        """Stop sending requests to the engine, for a weight sync; ``resume_generation`` undoes it.

        New requests wait (their calls block) until ``resume_generation``. The requests in flight:
        ``abort_in_flight=False``: run to their end on the current weights; returns, once they all
        have, how many there were. ``abort_in_flight=True``: are cut now and resume on the weights of
        resume time, from prompt + tokens so far with the tokens left (one ``Sample`` per request in
        the end; docs/rollout_engine.md); returns how many were cut (a request that ended on its own at
        that moment, or had no token left, just ends). A stop string spanning a cut ends the
        response where an uncut request would have ended (docs/rollout_engine.md).
        ``update_weights`` works while paused. One sync at a time: do not call it again before
        ``resume_generation``.
        """
        return self._run(generation.pause(self, abort_in_flight))

    def resume_generation(self) -> None:
        """Reopen the gate: waiting and cut requests go on (cut ones with the weights now loaded)."""
        self._on_loop(self._gate.set)

    def routes_missing(self) -> dict:
        """MoE route recording's misses: {"parts": engine requests lacking rows they computed, "rows": how
        many rows} (rlmega/rollout/engine_routes.py); zeros when routes are not recorded."""
        r = self._routes
        return {
            "parts": 0 if r is None else r.missing_parts,
            "rows": 0 if r is None else r.missing_rows,
        }

    def busy_seconds(self) -> float:
        """Wall seconds (monotonic) since the engine started with at least one engine request running.

        Requests waiting at a paused gate do not count. Divide by wall time for a busy fraction.
        """
        return self._on_loop(
            lambda: (
                self._busy_closed + (time.monotonic() - self._busy_since if self._running else 0.0)
            )
        )

    # ---- weights: one reload in the engine per sync (rlmega/rollout/weight_stream.py) -------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load HF-named tensors in place (any iterable, any subset) and set ``version``; loaded when it
        returns. Thread-safe: calls at the same time share one reload.

        A partial set is fine, and a call may end inside a fused vLLM layer: that layer's tensors wait
        here until the rest arrive in a later call (rlmega/sync/fused_layers.py). Prefix cache reset.
        """
        # TODO(gpu): vLLM's weight-transfer API (init_weight_transfer_engine / update_weights over
        # NCCL, vllm/distributed/weight_transfer/) avoids the host round trip on GPU; CudaIpcTransport
        # (rlmega/sync/transports.py) is the same-node design: its records ran on one GPU, not yet via Ray.
        named_tensors = list(named_tensors)
        if any(isinstance(t, Piece) for _, t in named_tensors):
            raise ValueError(
                "update_weights takes whole tensors; TP ranks' blocks (rlmega/sync/pieces.py) go "
                "through receive_weights and finish_weights, one sender per rank, in one sync"
            )
        sender = object()
        self.receive_weights(named_tensors, version, sender)
        self.finish_weights(version, sender)

    def receive_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, sender
    ) -> None:
        """One bucket of a sync from ``sender`` (any hashable key, one per sending process); returns
        once the engine has it, before it is loaded. The sync's first bucket opens one reload in the
        engine, which holds the model (no engine step runs) until ``finish_weights``: send the buckets
        back to back. Requests sent meanwhile wait until the load ends."""
        self._weights.receive(named_tensors, version, sender)

    def begin_weights(self, version: int, sender, nbytes_hint: int) -> dict:
        """Open a sync for a sender on this node that writes its buckets itself (rlmega/sync/local_slots.py):
        the sync's directory, the model workers' folders in it, this worker's node, and what makes a
        whole vLLM layer (FusedLayers' arguments)."""
        import ray

        directory = self._weights.begin(version, sender, nbytes_hint)
        return {
            "directory": directory,
            "ranks": self._weights.ranks,
            "layers": self._layer_args,
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
        }

    def finish_weights(self, version: int, sender) -> list[str]:
        """``sender`` sent its last bucket; returns once every bucket of the sync is loaded (the reload
        ends when every sender that sent into it has finished), with the prefix cache reset and
        ``version`` set. Raises if the engine failed to load. It waits for the other senders: a Ray
        actor hosting the worker needs a thread per sender (rlmega/launch/engines.py gives 256).
        Returns the slots the model workers retired in that sync (rlmega/sync/shm_slots.py)."""
        return self._weights.finish(version, sender)

    def load_adapter(self, files: dict[str, bytes], version: int) -> None:
        """Serve a new version of the policy's LoRA adapter (a PEFT adapter folder's files, e.g.
        PolicyActor.adapter_for_rollout's) and set ``version``; loaded when it returns, and every engine request
        sent after it generates with it (rlmega/rollout/lora_serving.py). Needs ``lora_rank`` > 0."""
        if not self.lora_rank:
            raise RuntimeError("load_adapter: this engine was started without LoRA (lora_rank=0)")
        self._weights.check_ready()
        request, folder = lora_serving.load(self, files, version)
        # cached KV of the old adapter is not this one's
        self._run(self._engine.reset_prefix_cache())

        # on the loop, where requests read them: new requests carry this version from here on
        def swap():
            self._lora, self._version = request, version

        self._on_loop(swap)
        # a request sent before the swap named it; its id is loaded
        lora_serving.remove_folder(self._lora_dir)
        self._lora_dir = folder

    def join_weight_group(
        self, name: str, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        """Join a sender's weight group (CollectiveTransport, rlmega/sync/collective.py); returns once
        every member has."""
        collective.join(name, host, port, rank, world, backend, timeout_s)

    def receive_broadcast(
        self, name: str, seq: int, toc: list, version: int, sender, timeout_s: float
    ) -> None:
        """Bucket ``seq`` of weight group ``name``: its bytes come by broadcast, ``toc`` says what they
        hold; then as ``receive_weights``."""
        self.receive_weights(collective.receive(name, seq, toc, timeout_s), version, sender)

    def start_profile(self, prefix: str) -> None:
        """Trace the engine until stop_profile (needs profile_dir); files are named ``prefix``_..."""
        self._run(self._engine.start_profile(prefix))

    def stop_profile(self) -> None:
        self._run(self._engine.stop_profile())

    def weight_version(self) -> int:
        return self._version

    def weight_reloads(self) -> int:
        """vLLM reloads this engine has run (one per weight sync or ``update_weights`` call)."""
        return self._weights.reloads

    def pending_weights(self) -> list[str]:
        """HF names held back because their vLLM layer is still incomplete."""
        return self._layers.pending()

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
            raise RuntimeError(
                "vLLM did not record kv_cache_max_concurrency (KV cache not sized yet?)"
            )
        return float(value)

    def engine_threads(self) -> list[int]:
        """Intra-op threads of each vLLM model worker (what ``num_threads`` set; docs/rollout_engine.md:
        CPU threads)."""
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

        Without it (an actor killed with SIGKILL) the children still go (docs/rollout_engine.md: Processes).
        """
        engine, self._engine = getattr(self, "_engine", None), None
        loop = getattr(self, "_loop", None)
        if engine is not None:
            try:  # on the loop: AsyncLLM cancels its output handler there
                self._run(shutdown_engine(engine))
            # teardown is best effort: report, never mask the caller's error
            except Exception as exc:
                logger.warning("vLLM engine shutdown raised %r", exc)
        if getattr(self, "_weights", None) is not None:
            self._weights.close()  # the shared-memory slots the engine read the weights from
        lora_serving.remove_folder(getattr(self, "_lora_dir", None))
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                loop.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def _call(fn):
    return fn()
