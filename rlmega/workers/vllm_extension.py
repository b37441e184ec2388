"""Methods that run inside each vLLM worker process, for RolloutWorker.

RolloutWorker's AsyncLLM keeps its engine core, and the model, in other processes, so it cannot
hand the model a Python generator as the in-process ``LLM`` could. vLLM's documented hook for code
that must run next to the model is the ``worker_extension_cls`` engine argument: vLLM mixes this
class into its worker class, and ``await engine.collective_rpc("method", args=(...))`` calls the
method on every worker (one per TP rank) and returns their results as a list.

Arguments cross two process boundaries serialised (msgpack to the engine core, then the
executor's message queue to the workers): a torch tensor arrives as nested lists there, bytes
arrive intact. So weights travel as one safetensors blob per call (``pack_weights``), which the
worker turns back into tensors without a Python-level copy per element.

Names carry an ``rlmega_`` prefix: vLLM's own worker already has methods such as ``update_weights``
(its weight-transfer API), and an extension must not shadow them.
"""
from __future__ import annotations

import time

import torch

EXTENSION = "rlmega.workers.vllm_extension.RolloutExtension"  # the engine argument's value


def pack_weights(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """HF-named tensors -> safetensors bytes (host memory, contiguous: what safetensors stores)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors})


class RolloutExtension:
    """Mixed into vLLM's worker: ``self`` is the worker, ``self.model_runner`` its model runner."""

    def rlmega_reload_weights(self, payload: bytes) -> int:
        """Load a safetensors blob of HF-named tensors in place; returns how many tensors it held.

        ``reload_weights`` (not ``model.load_weights``) because the CPU backend repacks linear
        weights after loading (see rlmega/workers/rollout.py).
        """
        from safetensors.torch import load

        tensors = load(payload)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def rlmega_param_names_and_packing(self) -> tuple[list[str], dict[str, list[str]]]:
        """The vLLM model's parameter names and its ``packed_modules_mapping`` (fused -> HF shards)."""
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return [name for name, _ in model.named_parameters()], {k: list(v) for k, v in packed.items()}

    def rlmega_watch_owner(self, owner_pid: int, interval_s: float = 0.5) -> int:
        """Kill this process (and the engine core above it) once the RolloutWorker's process is gone.

        vLLM's engine core does not watch the process that started it: a RolloutWorker killed with
        SIGKILL (a Ray actor killed, OOM) left it running, idle or finishing its requests (measured).
        So a daemon thread here polls the owner and kills what it would orphan: this process, and, when
        this is a model worker under the engine core (the multiprocess executor), the engine core too
        (the other workers follow it through vLLM's death pipe). A dead owner is one that has exited or
        is a zombie; psutil checks the creation time, so a reused pid is not the owner. Returns this pid.
        """
        import os
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
