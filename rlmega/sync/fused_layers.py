"""Which HF tensors fill which vLLM layer, and holding a layer's tensors back until all have come.

vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, a layer's weight and bias load
together, and an MoE layer's experts are one module filled from every expert's gate/up/down. Its
reload processes (repacks) a layer once all of its elements have loaded; a layer only partly
present when a reload ends is materialised with ``torch.empty`` for the missing part
(``finalize_layerwise_processing`` -> "Delayed processing"): garbage. So the RolloutWorker passes
on whole layers only: a bucket boundary between ``q_proj.weight`` and ``k_proj.weight`` (or a weight
and its bias) leaves the pieces here until the rest arrives, in a later bucket, from any thread.
A name that maps to no vLLM layer (a tied ``lm_head.weight``) goes straight on: vLLM decides.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class FusedLayers:
    def __init__(
        self, vllm_names: list[str], packed: dict[str, list[str]], experts: dict[str, list[str]]
    ):
        """``vllm_names``: the vLLM model's parameter names; ``packed``: its ``packed_modules_mapping``
        (fused -> HF shards); ``experts``: fused-experts module -> every HF name filling it
        (vllm_extension ``rlmega_expert_layers``)."""
        self._shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
        self._expert_layer = {n: module for module, names in experts.items() for n in names}
        self.members = _hf_names_by_layer(vllm_names, packed, experts)
        self._pending: dict[str, dict[str, Any]] = {}  # vLLM layer -> HF name -> tensor
        self._lock = threading.Lock()  # buckets of one sync may arrive on several threads

    def complete(self, named: Iterable[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
        """The whole layers that ``named`` completes (with what was held for them), one list each;
        the pieces of incomplete layers are held. Any value type (tensors, CUDA IPC handles)."""
        named = list(named)  # a generator is read outside the lock
        out = []
        with self._lock:
            for name, value in named:
                layer = self.layer_of(name)
                members = self.members.get(layer)
                # unknown (tied lm_head, ...) or unfused: pass on
                if members is None or len(members) == 1:
                    out.append([(name, value)])
                    continue
                group = self._pending.setdefault(layer, {})
                group[name] = value
                if members <= group.keys():
                    del self._pending[layer]
                    out.append(list(group.items()))
        return out

    def take_pending(self) -> list[tuple[str, Any]]:
        """The held-back tensors, handed over and forgotten here."""
        with self._lock:
            out = [item for group in self._pending.values() for item in group.items()]
            self._pending.clear()
        return out

    def pending(self) -> list[str]:
        """HF names held back because their vLLM layer is still incomplete."""
        with self._lock:
            return sorted(name for group in self._pending.values() for name in group)

    def check_none_pending(self) -> None:
        names = self.pending()
        if names:
            raise RuntimeError(
                f"{len(names)} weights wait for the rest of their fused vLLM layer (e.g. {names[:4]}); "
                "send the missing q/k/v, gate/up, expert or bias tensors with update_weights before generating"
            )

    def layer_of(self, hf_name: str) -> str:
        if hf_name in self._expert_layer:
            return self._expert_layer[hf_name]
        module = hf_name.rpartition(".")[0]
        head, _, leaf = module.rpartition(".")
        fused = self._shard_to_fused.get(leaf, leaf)
        return f"{head + '.' if head else ''}{fused}"


def _hf_names_by_layer(
    vllm_names: list[str], packed: dict[str, list[str]], experts: dict[str, list[str]]
) -> dict[str, set[str]]:
    """vLLM layer name -> the HF tensor names that fill it (q/k/v -> qkv_proj, gate/up -> gate_up_proj,
    and for a MoE layer every expert's gate/up/down -> ``<mlp>.experts.routed_experts``).

    An MoE layer's experts are one vLLM module holding two fused parameters (w13_weight: all experts'
    gate and up, w2_weight: their down), filled from E x 3 HF tensors; its processing after a reload
    (the CPU kernel's packing) needs all of them, so it is held back until every expert has arrived,
    like q/k/v. The router (``mlp.gate.weight``) is a plain layer.
    """
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
