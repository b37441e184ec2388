"""LoRA adapters on the policy (``actor.lora``): peft's layers in a Hugging Face model, and the tensors that leave it.

peft (the field's library) puts the adapters into the model in place (``inject_adapter_in_model``): the model
keeps its class and its HF names, and each target ``nn.Linear`` becomes a LoRA layer holding ``base_layer``
(the frozen W) and ``lora_A.default`` / ``lora_B.default``, so parameter names read

    model.layers.0.self_attn.q_proj.base_layer.weight       W (out, in), frozen
    model.layers.0.self_attn.q_proj.lora_A.default.weight   A (rank, in)
    model.layers.0.self_attn.q_proj.lora_B.default.weight   B (out, rank)

and the layer computes x W^T + scale (x A^T) B^T, scale = alpha / rank. Every other parameter is frozen too.

What leaves the learner (each a stream of (name, tensor) in the model's named_parameters order):
- ``merged_weights``: HF names, W + scale B A for adapted layers: a full weight sync (rollout.lora_merge), an
  export as a plain model;
- ``base_weights``: HF names, the base alone: the weights of an engine that serves the adapters unmerged;
- ``adapter_weights``: PEFT's saved names (``base_model.model.<module>.lora_A.weight``), the adapters only:
  ``adapter_model.safetensors`` of a folder ``peft.PeftModel.from_pretrained`` (and vLLM) loads
  (``write_adapter``, ``adapter_files``).
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import torch

from rlmega.config.schema import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # PeftModel's path to the HF model, in saved adapter names


def peft_config(cfg: LoraConfig):
    """peft's LoraConfig of ``actor.lora``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """``model`` with adapters in its target layers (A = ``initial_a``, so every rank builds the same; B zero),
    every other parameter frozen. The caller's RNG stream is left where it was."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        model = inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    # the init both learners share (initial_a), not peft's draw from the global stream
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                p.copy_(initial_a(seed, name.split(".lora_A.")[0], cfg.rank, p.shape[1]))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def initial_a(seed: int, module: str, rank: int, in_features: int) -> torch.Tensor:
    """A of the adapter on HF module ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) before training:
    (rank, in_features) float32, uniform in +-1/sqrt(in_features) (peft's kaiming_uniform(a=sqrt(5)) bound),
    drawn from a generator seeded by ``seed`` and the module's name. A function of the name alone, so that
    the FSDP learner (peft's layers) and the Megatron learner (fused, TP-split layers,
    rlmega/megatron/lora_adapters.py) start from the same adapters whatever order or rank builds them."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (
        torch.rand(rank, in_features, generator=g, dtype=torch.float64)
        .mul_(2 * bound)
        .sub_(bound)
        .float()
    )


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _layers(model: torch.nn.Module) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Inside, the model computes its base (the reference policy): every LoRA layer returns base_layer(x)."""
    layers = _layers(model)
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def hf_name(name: str) -> str:
    """A model parameter's name as the plain model has it (``.base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """An adapter parameter's name in a PEFT adapter file (``base_model.model.`` in front, the adapter's
    name dropped)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, full tensor) in named_parameters order -> (HF name, tensor) of the plain model: an adapted
    layer's W comes out as W + scale B A (computed in float32, in W's dtype), once its B has passed; A and B
    themselves do not come out. Holds at most one layer's W and A at a time."""
    pending: dict[str, dict] = {}
    for name, t in named:
        if name.endswith(".base_layer.weight"):
            pending[name[: -len(".base_layer.weight")]] = {"W": t}
        elif ".lora_A." in name:
            pending[name.split(".lora_A.")[0]]["A"] = t
        elif ".lora_B." in name:
            module = name.split(".lora_B.")[0]
            held = pending.pop(module)
            w = held["W"]
            yield (
                module + ".weight",
                (w.float() + scale * (t.float() @ held["A"].float())).to(w.dtype),
            )
        else:
            yield hf_name(name), t
    if pending:
        raise RuntimeError(
            f"LoRA layers without their adapters in the weight stream: {sorted(pending)[:3]}"
        )


def base_weights(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, tensor) -> (HF name, tensor) of the base model alone: W of adapted layers, A and B left out
    (what an engine that serves the adapters unmerged holds as its weights)."""
    for name, t in named:
        if not is_adapter(name):
            yield hf_name(name), t


def adapter_weights(
    named: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, tensor) -> (PEFT name, tensor) of the adapters only."""
    for name, t in named:
        if is_adapter(name):
            yield adapter_name(name), t


def write_adapter(
    out_dir: str, cfg: LoraConfig, tensors: dict[str, torch.Tensor], base_model: str = ""
) -> None:
    """A PEFT adapter folder: adapter_config.json (peft's own, ``base_model_name_or_path`` = ``base_model``)
    and adapter_model.safetensors (``tensors``: PEFT names). The caller writes into a partial folder and
    renames it into place."""
    from safetensors.torch import save_file

    config = peft_config(cfg)
    config.base_model_name_or_path = base_model or None
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        os.path.join(out_dir, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )


def adapter_files(cfg: LoraConfig, tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """The files of a PEFT adapter folder as bytes ({file name: bytes}: adapter_config.json,
    adapter_model.safetensors), for an engine that writes them into a folder of its own (vLLM loads adapters
    from folders). The tensors are serialised in memory (no file round trip: a sync's cost)."""
    import tempfile

    from safetensors.torch import save

    with tempfile.TemporaryDirectory() as d:  # peft writes its own config (a few hundred bytes)
        peft_config(cfg).save_pretrained(d)
        config = Path(d, "adapter_config.json").read_bytes()
    data = save(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata={"format": "pt"}
    )
    return {"adapter_config.json": config, "adapter_model.safetensors": data}
