"""Methods that run inside each vLLM worker process, for RolloutWorker.

RolloutWorker's AsyncLLM keeps its engine core, and the model, in other processes, so it cannot
hand the model a Python generator as the in-process ``LLM`` could. vLLM's documented hook for code
that must run next to the model is the ``worker_extension_cls`` engine argument: vLLM mixes this
class into its worker class, and ``await engine.collective_rpc("method", args=(...))`` calls the
method on every worker (one per TP rank) and returns their results as a list.

Arguments cross process boundaries msgpack-encoded (to the engine core, and at TP > 1 on through the
executor's message queue to the workers): a torch tensor arrives as a list there, bytes arrive
intact. Weights therefore go through shared memory (slots kept across syncs: rlmega/sync/shm_slots.py;
else files: rlmega/sync/bucket_files.py), and one sync is one call, ``rlmega_load_stream``: a
single ``reload_weights`` whose iterator reads the buckets as the RolloutWorker writes them, until
the sync's end. While it runs the engine core runs nothing else (a utility call blocks its loop):
no step ever sees a half-loaded model. Why one call per sync, not per bucket: each
``reload_weights`` restores every layer of the model on the meta device, puts back the ones it did
not load and re-processes every attention layer; the tied-head rebuild, the CPU expert repack and
the prefix-cache reset follow it. Measured (tools/bench/weight_sync.py,
0.4 GB): a sync cost 2.37x vLLM's own reload of the same tensors at TP1 and 4.34x at TP2xPP2 with one
reload per bucket (safetensors files read into memory), 2.10x and 3.04x with one per sync
(docs/rollout_engine.md: where the rest goes).

Names carry an ``rlmega_`` prefix: vLLM's own worker already has methods such as ``update_weights``
(its weight-transfer API), and an extension must not shadow them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import torch

from rlmega.sync import bucket_files
from rlmega.sync.shm_slots import SlotReader
from rlmega.rollout.route_store import RouteStore

EXTENSION = "rlmega.rollout.vllm_extension.RolloutExtension"  # the engine argument's value


def tied_layer_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Module]]]:
    """(name, module) lists of the modules that hold one parameter object between them.

    vLLM ties ``lm_head`` to ``model.embed_tokens`` by assigning the embedding's Parameter to the head
    (``tie_weights``), so both modules hold the same tensor: the head's name is in neither the
    checkpoint nor a reload.
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append((name, module))
    return [mods for mods in owners.values() if len(mods) > 1]


def _refresh_tied_layers(model: torch.nn.Module, loaded: list[str]) -> list[str]:
    """Re-process every module that shares a parameter with a module whose weights just reloaded.

    Why: ``reload_weights`` processes a layer once its own weights have arrived
    (``process_weights_after_loading``). On CPU that step also builds the layer's GEMM kernel from a
    packed *copy* of the weight (``dispatch_cpu_unquantized_gemm``: oneDNN / sgl handles), and the tied
    ``lm_head`` computes the logits with its kernel. The reload refills the shared tensor in place but
    never processes the head (none of its names arrive), so the head's packed copy kept the weights of
    the engine's start: the engine's logits drifted from the trainer's with every update (issue 22 A).
    Processing the head again rebuilds its kernel from the shared tensor; on GPU the embedding method's
    processing does nothing. Returns the names of the modules re-processed.
    """
    done = []
    for group in tied_layer_groups(model):
        reloaded = {name for name, _ in group if any(n.startswith(name + ".") for n in loaded)}
        if not reloaded:
            continue
        for name, module in group:
            if name in reloaded:  # the reload processed it already
                continue
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                done.append(name)
    return done


def _repack_cpu_experts(model: torch.nn.Module, loaded: list[str]) -> list[str]:
    """Prepack again, for the CPU MoE kernel, the experts of every MoE layer whose weights just reloaded.

    Why: vLLM's CPU experts (``CPUUnquantizedExperts``, fused_moe/experts/cpu_moe.py) keep w13/w2 in a
    prepacked grouped-GEMM layout made by their ``process_weights_after_loading``, which vLLM 0.32 runs
    at the first load only: on a weight update ``UnquantizedFusedMoEMethod._setup_kernel`` copies the
    plain (experts, 2I, H) tensors into the packed storage and skips it (``is_weight_update``), so the
    kernel read plain weights as packed ones. Measured on the tiny Qwen3-MoE: after reloading the very
    weights it started with, log-probs were off by 0.036 and 4-7% of layer-1 routes differed; with this
    repack, equal to transformers (tests/e2e/test_engine_routes.py). GPU kernels take the plain layout
    that copy wrote (TODO(gpu): check each MoE backend there). Returns the layers repacked.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    done = []
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        # "<mlp>.experts." (HF: <mlp>.experts.<e>.gate_proj.weight)
        base = name.rpartition(".")[0] + "."
        if not any(n.startswith(base) for n in loaded):
            continue
        experts = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(module)
            done.append(name)
    return done


class RolloutExtension:
    """Mixed into vLLM's worker: ``self`` is the worker, ``self.model_runner`` its model runner."""

    def rlmega_rank(self) -> int:
        """The name of this worker's folder in a sync directory (bucket_files)."""
        return int(getattr(self, "rank", 0))

    def rlmega_load_stream(self, directory: str, idle_timeout_s: float) -> dict:
        """Load, in place, every bucket written to this worker's folder of ``directory`` until the
        sync ends; one ``reload_weights`` for them all. Returns {"tensors": how many it loaded,
        "seconds": the call's time, "waited_s": of which waiting for buckets}.

        ``reload_weights`` (not ``model.load_weights``) because the CPU backend repacks linear weights
        after loading, layer by layer, once a layer's tensors have all arrived. A bucket holds whole
        vLLM layers only (the RolloutWorker holds back a fused layer's tensors until all have come:
        rlmega/sync/fused_layers.py), so a stream cut short between buckets leaves no layer half
        written: what did not arrive keeps its old weights, and the error is raised.
        """
        names: list[str] = []
        start, waited = time.perf_counter(), [0.0]
        slots = getattr(self, "_rlmega_slots", None)
        if slots is None:  # kept for the worker's life: each slot mapped once (shm_slots.py)
            slots = self._rlmega_slots = SlotReader()

        def weights():
            for name, tensor in bucket_files.read_stream(
                directory, self.rlmega_rank(), idle_timeout_s, waited, slots
            ):
                names.append(name)
                yield name, tensor

        model = self.model_runner.get_model()
        try:
            self.model_runner.reload_weights(weights_iterator=weights())
        except BaseException:
            # The layers still on the meta device (not loaded yet) get their old tensors back.
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            with contextlib.suppress(Exception):
                finalize_layerwise_reload(model, self.model_runner.model_config)
            raise
        finally:
            slots.finish()  # (first: a slot still viewed is retired before its ticket goes)
            shutil.rmtree(os.path.join(directory, str(self.rlmega_rank())), ignore_errors=True)
        _refresh_tied_layers(model, names)
        _repack_cpu_experts(model, names)
        return {
            "tensors": len(names),
            "seconds": time.perf_counter() - start,
            "waited_s": waited[0],
        }

    def rlmega_param_names_and_packing(self) -> tuple[list[str], dict[str, list[str]]]:
        """The vLLM model's parameter names and its ``packed_modules_mapping`` (fused -> HF shards)."""
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return [name for name, _ in model.named_parameters()], {
            k: list(v) for k, v in packed.items()
        }

    def rlmega_watch_owner(self, owner_pid: int, interval_s: float = 0.5) -> int:
        """Kill this process (and the engine core above it) once the RolloutWorker's process is gone.

        vLLM's engine core does not watch the process that started it: a RolloutWorker killed with
        SIGKILL (a Ray actor killed, OOM) left it running, idle or finishing its requests (measured).
        So a daemon thread here polls the owner and kills what it would orphan: this process, and, when
        this is a model worker under the engine core (the multiprocess executor), the engine core too
        (the other workers follow it through vLLM's death pipe), after deleting the weight buckets the
        owner staged and could not delete. A dead owner is one that has exited or is a zombie; psutil checks
        the creation time, so a reused pid is not the owner. Returns this pid.
        """
        import threading

        import psutil

        owner = psutil.Process(owner_pid)
        me = psutil.Process()
        victims = [me]
        parent = me.parent()
        if parent is not None and parent.pid != owner_pid and parent.ppid() == owner_pid:
            victims.insert(0, parent)

        def gone() -> bool:
            try:
                return not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                return True

        def watch() -> None:
            while not gone():
                time.sleep(interval_s)
            # a sync the owner was sending when it died
            for path in bucket_files.staged_by(owner_pid):
                shutil.rmtree(path, ignore_errors=True)
            for p in victims:
                try:
                    p.kill()
                except psutil.Error:
                    pass

        threading.Thread(target=watch, name="rlmega-owner-watch", daemon=True).start()
        return os.getpid()

    def rlmega_num_threads(self) -> int:
        """Intra-op threads this worker computes with (RolloutWorker's ``num_threads``)."""
        return torch.get_num_threads()

    def rlmega_time_reload(self, model_path: str, order: list[str]) -> float:
        """Seconds of one ``reload_weights`` of the model folder's whole state dict, held here.

        The weight-sync benchmark's floor (tools/bench/weight_sync.py): the tensors are read into this
        worker's memory once (in ``order``, the order syncs deliver them, then the rest), so the time is
        vLLM's own reload alone: nothing gathered, serialised or sent.
        """
        held = getattr(self, "_rlmega_held", None)
        if held is None:
            from safetensors.torch import load_file

            tensors = load_file(f"{model_path}/model.safetensors")
            rank = {n: i for i, n in enumerate(order)}
            names = sorted(tensors, key=lambda n: (rank.get(n, len(rank)), n))
            held = self._rlmega_held = [(n, tensors[n].clone()) for n in names]
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(held))
        return time.perf_counter() - t0

    # ---- MoE: the fused expert layout (weight sync) and the routes each token took (R3) ----------
    def rlmega_expert_layers(self) -> dict[str, list[str]]:
        """vLLM fused-experts module -> the HF tensor names that fill it (every expert's gate/up/down).

        vLLM keeps a MoE layer's experts as two fused parameters, ``<mlp>.experts.routed_experts.w13_weight``
        (E, 2I, H) and ``.w2_weight`` (E, H, I); the checkpoint has one tensor per expert and projection
        (``<mlp>.experts.<e>.gate_proj.weight`` ...). The mapping is the layer's own
        (``RoutedExperts.get_expert_mapping``: (param, "experts.<e>.gate_proj.", e, shard) rows), so
        another family's names (Mixtral's w1/w2/w3) come out right too.
        """
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        out: dict[str, list[str]] = {}
        for name, module in self.model_runner.get_model().named_modules():
            if not isinstance(module, RoutedExperts):
                continue
            # name: "<mlp>.experts.routed_experts"; the mapping's weight names start at "experts."
            base = name.rpartition(".")[0].rpartition(".")[0]
            out[name] = sorted(
                {
                    f"{base}.{weight}weight"
                    for _, weight, _, _ in module.get_expert_mapping()
                    if ".gate_up_proj" not in weight and ".w13" not in weight
                }
            )
        return out

    def rlmega_record_routes(self) -> dict | None:
        """Start recording the experts every MoE router picks for every token this engine computes.

        Why our own capture: vLLM's ``enable_return_routed_experts`` needs Model Runner V2 (Triton),
        which the CPU build lacks. Each ``MoERunner``'s router calls ``capture_fn(topk_ids)``
        (``BaseRouter._select_experts``, before any EPLB mapping: logical expert ids) once per forward,
        with one (num_tokens, topk) row per token of the step, in the model runner's flattened order:
        the requests of ``input_batch.req_ids`` one after another, ``num_scheduled_tokens`` each,
        starting at position ``num_computed_tokens`` (``GPUModelRunner._prepare_inputs``). So
        ``_prepare_inputs`` is wrapped to note that layout, ``execute_model`` to hand the step's rows
        out to a per-request store (``RouteStore``, rlmega/rollout/route_store.py) once the forward is
        done; ``rlmega_take_routes`` returns and forgets them. A recomputed position (a preempted
        request's re-prefill) overwrites
        its row; positions the step did not compute (prefix-cache hits) have none.

        TP: the router's gate is replicated and its input is the all-reduced hidden state, the same on
        every TP rank, so only rank 0 records (the other ranks return None). Returns
        {"layers": model-wide index of each MoE layer, in order, "topk", "num_experts"}, or raises
        when the model has no MoE router.
        """
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in self.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError(
                "routes asked for (algorithm.routing_replay=rollout), but the engine's model "
                "has no MoE layer: use routing_replay=none for a dense model"
            )
        layer_ids = sorted({m.layer_id for m in runners})
        info = {
            "layers": layer_ids,
            "topk": int(runners[0].router.top_k),
            "num_experts": int(runners[0].router.global_num_experts),
        }
        if get_tp_group().rank_in_group != 0:
            return None
        if getattr(self, "_rlmega_routes", None) is not None:
            return info
        store = self._rlmega_routes = RouteStore(len(layer_ids), info["topk"])
        index = {lid: i for i, lid in enumerate(layer_ids)}
        for m in runners:
            m.router.set_capture_fn(lambda ids, i=index[m.layer_id]: store.capture(i, ids))
        runner = self.model_runner
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            # values as _prepare_inputs reads them (it does not change them)
            n = runner.input_batch.num_reqs
            store.layout = (
                list(runner.input_batch.req_ids[:n]),
                num_scheduled_tokens[:n].copy(),
                runner.input_batch.num_computed_tokens_cpu[:n].copy(),
            )
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(scheduler_output, *args, **kwargs):
            store.begin_step(scheduler_output.finished_req_ids)
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                store.end_step()  # the forward ran inside execute_model (sampling comes later)

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model
        return info

    def rlmega_take_routes(self, request_ids: list[str]) -> dict | None:
        """{rlmega request id: (bytes, shape)} of the routes recorded for each (then forgotten).

        ``request_ids`` are the ids rlmega gave ``AsyncLLM.generate`` (vLLM suffixes them internally:
        ``RouteStore.take`` matches them). The array is int16 (positions, num_moe_layers, topk), row j =
        position j, -1 rows where nothing was computed. An id without routes is left out. None on TP
        ranks > 0 (they record nothing).
        """
        store = getattr(self, "_rlmega_routes", None)
        return None if store is None else store.take(request_ids)

    def rlmega_routes_held(self) -> int | None:
        """Requests whose routes the store holds (taken ones are gone): a leak check."""
        store = getattr(self, "_rlmega_routes", None)
        return None if store is None else len(store.rows)
