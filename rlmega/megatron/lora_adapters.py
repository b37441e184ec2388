"""LoRA adapters on the Megatron learner (actor.lora): TP-aware adapters around megatron-core's
ColumnParallelLinear / RowParallelLinear, one set per HF target module.

    adapters = add_adapters(chunks, lora_cfg, shape, seed, sequence_parallel=sp)  # HF weights in, before DDP
    with disabled(adapters): ...                            # the base model (the reference)
    full = adapter_tensors(adapters)                        # {PEFT name: whole tensor}, collective
    merged = adapters[id(param)].merged_weight(param.data)  # W + scale B A, this rank's block

Megatron fuses HF modules: ``linear_qkv`` holds q_proj, k_proj, v_proj (per KV group [q_g; k_g; v_g]) and
``linear_fc1`` holds [gate_proj; up_proj] (rlmega/megatron/hf_weights.py). The adapters are kept per HF module
(q_proj's A and B, k_proj's, ...), as peft and vLLM name them, and their outputs are fused into the linear's
layout. The base linear is left as megatron-core built it (its parameters keep their names: HF loading,
checkpoints and weight sync see no change); the adapters are a sibling module ``<linear>_lora`` whose output a
forward hook adds to the linear's. Megatron-bridge has LoRA for Megatron (megatron.bridge.peft.lora), but its
0.3.1, the version the registry serves here, needs transformers < 5 and CUDA Transformer Engine; its split
of A and B over TP is the one used here:

    column-parallel W (out/TP rows per rank), y = x W^T:  A (r, in) whole on every TP rank, B (out/TP, r)
        h = x A^T            replicated over TP (under SP: this rank's tokens, then all-gathered)
        y_local = h B_local^T
    row-parallel W (in/TP columns per rank), y = sum_TP x_local W_local^T:  A (r, in/TP), B (out, r) whole
        h = sum_TP x_local A_local^T   (all-reduced; under SP reduce-scattered to this rank's tokens)
        y = h B^T

Gradients: with h passed through copy_to_tensor_model_parallel_region (no SP), a column A's gradient is whole
on every TP rank; under SP a column's A and a row's B see this rank's tokens only, so they are marked
``sequence_parallel`` and megatron's finalize_model_grads sums their gradients over TP (as it does for norms).
The TP-split tensors carry megatron's tensor-parallel attributes (grad norm counted once, checkpoints
sharded along their split axis).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rlmega.learner import lora
from rlmega.config.lora_rules import MEGATRON_TARGETS, MLP_TARGETS
from rlmega.config.schema import LoraConfig
from rlmega.megatron.hf_config import ModelShape
from rlmega.megatron.hf_io import unwrap

SUFFIX = "_lora"  # the adapters of linear X are the sibling module X_lora


@dataclass(frozen=True)
class Site:
    """One Megatron linear of a transformer layer and the HF modules it fuses, in its layout's order."""

    block: str  # the layer's submodule: self_attention / mlp
    linear: str  # linear_qkv / linear_proj / linear_fc1 / linear_fc2
    parallel: str  # column / row
    hf_block: str  # self_attn / mlp
    targets: tuple[str, ...]


SITES = (
    Site("self_attention", "linear_qkv", "column", "self_attn", ("q_proj", "k_proj", "v_proj")),
    Site("self_attention", "linear_proj", "row", "self_attn", ("o_proj",)),
    Site("mlp", "linear_fc1", "column", "mlp", ("gate_proj", "up_proj")),
    Site("mlp", "linear_fc2", "row", "mlp", ("down_proj",)),
)
TARGETS = tuple(t for s in SITES for t in s.targets)  # what actor.lora.target_modules may name here
assert TARGETS == MEGATRON_TARGETS, (
    "config/lora_rules.py checks target_modules against its copy of SITES' names"
)


def target_shape(target: str, shape: ModelShape) -> tuple[int, int]:
    """(out, in) features of HF module ``target`` (whole, unsplit)."""
    h, q, kv, f = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.ffn_hidden_size,
    )
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }[target]


class SiteAdapters(torch.nn.Module):
    """The adapters of one Megatron linear (its present HF targets), this TP rank's part of them.

    Parameters ``{target}_A`` / ``{target}_B``; ``delta(x)`` is what they add to the linear's output
    (x: the linear's input, [s, b, in] or [s, b, in/TP]; returns [s, b, out/TP] for a column, [s, b, out] or
    its SP share for a row)."""

    def __init__(
        self,
        site: Site,
        present: list[str],
        shape: ModelShape,
        cfg: LoraConfig,
        layer: int,
        seed: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
    ):
        super().__init__()
        self.site, self.present, self.shape = site, present, shape
        self.scale = cfg.alpha / cfg.rank
        self.rank_r = cfg.rank
        self.layer = layer  # model-wide 0-based index
        self.sequence_parallel = sequence_parallel
        self.enabled = True
        self.tp_rank, self.tp = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        column = site.parallel == "column"
        for t in present:
            out, _ = target_shape(t, shape)
            a = lora.initial_a(seed, self.hf_module(t), cfg.rank, target_shape(t, shape)[1])
            b = torch.zeros(out, cfg.rank)
            if column:
                b = b.chunk(self.tp, dim=0)[self.tp_rank]
            else:
                a = a.chunk(self.tp, dim=1)[self.tp_rank]
            pa, pb = (torch.nn.Parameter(v.to(dtype).contiguous()) for v in (a, b))
            split, whole = (pb, pa) if column else (pa, pb)
            set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
            set_tensor_model_parallel_attributes(whole, False, 0, 1)
            # under SP the whole one sees this rank's tokens only: finalize_model_grads sums it over TP
            whole.sequence_parallel = sequence_parallel
            self.register_parameter(f"{t}_A", pa)
            self.register_parameter(f"{t}_B", pb)

    def hf_module(self, target: str) -> str:
        return f"model.layers.{self.layer}.{self.site.hf_block}.{target}"

    def _a(self, t: str) -> torch.Tensor:
        return getattr(self, f"{t}_A")

    def _b(self, t: str) -> torch.Tensor:
        return getattr(self, f"{t}_B")

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        r = self.rank_r
        if self.site.parallel == "row":
            t = self.present[0]
            h = F.linear(x, self._a(t))  # this rank's part of the sum over the input's TP split
            h = (
                reduce_scatter_to_sequence_parallel_region(h)
                if self.sequence_parallel
                else reduce_from_tensor_model_parallel_region(h)
            )
            return F.linear(h, self._b(t)) * self.scale
        h = F.linear(x, torch.cat([self._a(t) for t in self.present]))  # one matmul for all targets
        h = (
            gather_from_sequence_parallel_region(h)
            if self.sequence_parallel
            else copy_to_tensor_model_parallel_region(h)
        )
        ys = {
            t: F.linear(h[..., i * r : (i + 1) * r], self._b(t)) for i, t in enumerate(self.present)
        }
        return self.fuse(ys, h.shape[:-1], h) * self.scale

    def fuse(
        self, parts: dict[str, torch.Tensor], lead: torch.Size, like: torch.Tensor
    ) -> torch.Tensor:
        """Per-target outputs ([*lead, out_t/TP], absent targets zero) -> the column linear's local layout
        [*lead, out/TP]: per KV group [q_g; k_g; v_g] for linear_qkv, [gate; up] for linear_fc1."""

        def part(t: str) -> torch.Tensor:
            if t in parts:
                return parts[t]
            return like.new_zeros(*lead, target_shape(t, self.shape)[0] // self.tp)

        if self.site.linear != "linear_qkv":
            return torch.cat([part(t) for t in self.site.targets], dim=-1)
        groups = self.shape.num_kv_heads // self.tp
        return torch.cat(
            [part(t).reshape(*lead, groups, -1) for t in self.site.targets], dim=-1
        ).reshape(*lead, -1)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's block of the linear's weight with the adapters merged: W + scale B A, computed in float32,
        returned in W's dtype (as rlmega.learner.lora.merged_weights does for the FSDP learner)."""
        if self.site.parallel == "row":
            t = self.present[0]
            delta = self._b(t).float() @ self._a(t).float()
        else:  # fuse along the output: delta^T = A^T B^T per target, fused as outputs are
            parts = {t: self._a(t).float().t() @ self._b(t).float().t() for t in self.present}
            delta = self.fuse(parts, torch.Size([weight.shape[1]]), weight.float()).t()
        return (weight.float() + self.scale * delta).to(weight.dtype)

    def named(self):
        """(PEFT name, parameter, the dim it is split along over TP or None) of this linear's adapters."""
        for t in self.present:
            for which, p in (("A", self._a(t)), ("B", self._b(t))):
                split = (
                    p.partition_dim
                    if getattr(p, "tensor_model_parallel", False) and self.tp > 1
                    else None
                )
                yield f"{lora.PEFT_PREFIX}{self.hf_module(t)}.lora_{which}.weight", p, split

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        """Megatron dist-checkpointing: the TP-split tensors sharded along their split axis, the rest replicated
        (megatron's own ColumnParallelLinear does the same for its weight)."""
        split = {
            f"{t}_{'B' if self.site.parallel == 'column' else 'A'}": 0
            if self.site.parallel == "column"
            else 1
            for t in self.present
        }
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, split, sharded_offsets
        )


def _hook(adapters: SiteAdapters):
    """The linear's forward hook: its (output, bias) with the adapters' delta added to the output."""

    def add_delta(module, args, kwargs, output):
        if not adapters.enabled:
            return output
        out, bias = output
        return out + adapters.delta(args[0] if args else kwargs["input_"]), bias

    return add_delta


def add_adapters(
    chunks: list, cfg: LoraConfig, shape: ModelShape, seed: int, sequence_parallel: bool
) -> dict[int, SiteAdapters]:
    """Adapters on every target linear of every layer of this rank's chunks (unwrapped GPTModels), every
    other parameter frozen. Returns {id(linear weight): its adapters} (the merged sync looks them up).
    A is ``rlmega.learner.lora.initial_a`` (the FSDP learner's too), B zero."""
    targets = set(cfg.target_modules)
    unknown = sorted(targets - set(TARGETS))
    if unknown:  # refused at load (config/lora_rules.py); here for callers that skip validate
        raise ValueError(
            f"actor.lora.target_modules {unknown}: the Megatron learner adapts {list(TARGETS)}"
        )
    if shape.is_moe and targets & set(MLP_TARGETS):
        raise ValueError(
            "actor.lora.target_modules: LoRA on MoE experts is not built; adapt the attention "
            "projections (q_proj, k_proj, v_proj, o_proj) of an MoE model"
        )
    found: dict[int, SiteAdapters] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.decoder.layers:
            for site in SITES:
                present = [t for t in site.targets if t in targets]
                if not present:
                    continue
                block = getattr(layer, site.block)
                linear = getattr(block, site.linear)
                if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
                    raise ValueError(
                        f"actor.lora on the Megatron learner wraps megatron-core's ColumnParallelLinear "
                        f"and RowParallelLinear (the local layer spec); {site.block}.{site.linear} is "
                        f"{type(linear).__name__} (Transformer Engine's fused layers are not wired)"
                    )
                adapters = SiteAdapters(
                    site,
                    present,
                    shape,
                    cfg,
                    layer.layer_number - 1,
                    seed,
                    linear.weight.dtype,
                    sequence_parallel,
                ).to(linear.weight.device)
                block.add_module(site.linear + SUFFIX, adapters)
                linear.register_forward_hook(_hook(adapters), with_kwargs=True)
                found[id(linear.weight)] = adapters
    return found


def is_adapter(name: str) -> bool:
    """A Megatron parameter name of an adapter (``...linear_qkv_lora.q_proj_A``)."""
    return f"{SUFFIX}." in name


@contextlib.contextmanager
def disabled(adapters: dict[int, SiteAdapters]):
    """Inside, the model computes its base (the reference policy)."""
    for a in adapters.values():
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters.values():
            a.enabled = True


@torch.no_grad()
def adapter_tensors(adapters: dict[int, SiteAdapters]) -> dict[str, torch.Tensor]:
    """{PEFT name: whole tensor} of every adapter of the model, on every rank (CPU float32; at TP1 x PP1 views of
    the float32 parameters: engine_api's adapter_tensors). Collective over
    the TP group and the pipeline group: one all-gather of this rank's TP-split tensors flattened into one
    buffer, then one of each stage's whole tensors (a collective per tensor, or pickled tensors, cost ~0.1 s a
    sync at rank 16 on the 0.40 GB model over gloo: more than the rest of a LoRA sync)."""
    entries = [
        e
        for a in sorted(adapters.values(), key=lambda a: (a.layer, SITES.index(a.site)))
        for e in a.named()
    ]
    mine = {name: p.data.float() for name, p, split in entries if split is None}
    split = [(name, p, dim) for name, p, dim in entries if dim is not None]
    if split:
        flat = torch.cat([p.data.float().reshape(-1) for _, p, _ in split])
        tp = ps.get_tensor_model_parallel_world_size()
        parts = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(parts, flat, group=ps.get_tensor_model_parallel_group())
        at = 0
        for name, p, dim in split:
            n = p.numel()
            mine[name] = torch.cat([part[at : at + n].view(p.shape) for part in parts], dim=dim)
            at += n
    mine = {name: mine[name] for name, _, _ in entries}  # the model's order
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return {k: v.cpu() for k, v in mine.items()}
    group = ps.get_pipeline_model_parallel_group()
    layouts: list = [None] * pp
    dist.all_gather_object(layouts, [(k, tuple(v.shape)) for k, v in mine.items()], group=group)
    sizes = [sum(torch.Size(s).numel() for _, s in lay) for lay in layouts]
    flat = torch.cat([v.reshape(-1) for v in mine.values()]) if mine else torch.zeros(0)
    # all_gather takes equal sizes
    flat = torch.cat([flat, flat.new_zeros(max(sizes) - flat.numel())])
    stages = [torch.empty_like(flat) for _ in range(pp)]
    dist.all_gather(stages, flat, group=group)
    out = {}
    for lay, stage in zip(layouts, stages):
        at = 0
        for name, shape in lay:
            n = torch.Size(shape).numel()
            out[name] = stage[at : at + n].view(shape).cpu()
            at += n
    return out
