"""FSDPModelManager: one trainer rank's FSDP2-sharded HF model, optimizer, LR schedule and state.

    init_distributed()                                   # rlmega.process.distributed
    mm = FSDPModelManager(cfg.model, cfg.optimizer, cfg.actor, world_size, rank, lr_decay_steps=100)
    mm.setup_model_and_optimizer()                       # HF model, fully_shard, AdamW, schedule
    for i, mb in enumerate(micro_batches):
        mm.before_micro_batch(mm.model, is_last_micro_batch=i == len(micro_batches) - 1)
        loss(mm.model(**mb)).backward()                  # the caller's loss, averaged over the global batch
    taken, grad_norm, lr = mm.optimizer_step()           # StepResult (taken iff grad_norm is finite)
    mm.save_checkpoint("runs/x/checkpoints", step=1)     # DCP, sharded, atomic (fsdp/checkpoint.py)

Layout: every parameter is sharded over all ``world_size`` ranks (dim 0) as a DTensor; each decoder
layer is its own FSDP unit (gathered for its forward/backward, then freed), the root holds the
embeddings, final norm and head. Gradients are reduce-scattered and *averaged* over ranks (as
Megatron DDP averages over data-parallel ranks), so a loss that is each rank's mean over its share
of an evenly split batch gives the gradient of the global mean. Names follow RLinf's FSDP manager.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlmega.learner import lora, offload
from rlmega.algorithms.lr_schedule import LRSchedule
from rlmega.rundir.checkpoint_files import finish_export
from rlmega.config.families import family
from rlmega.config.lora_rules import checkpoint_record
from rlmega.config.schema import ActorConfig, ModelConfig, OptimizerConfig
from rlmega.learner.engine_api import StepResult
from rlmega.fsdp import checkpoint, family_check, packed_attention, recurrent_layers, vision_inputs


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of FSDP2's storage); a plain tensor as it is."""
    if isinstance(t, DTensor):
        # without grad mode to_local is the local tensor itself, no autograd view
        with torch.no_grad():
            return t.to_local()
    return t


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: ``model.model.layers`` when the model has it, else
    the modules whose class transformers lists in ``_no_split_modules`` (its own 'a layer' marker)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found (no model.layers, and no module of a "
            f"class in _no_split_modules={sorted(names)}); actor.backend=fsdp cannot shard it by layer"
        )
    return found


class FSDPModelManager:
    AUTO_CLASS = "AutoModelForCausalLM"
    """The transformers auto class an export is rebuilt with (a subclass whose ``model_provider_func``
    builds another head names its own: rlmega/fsdp/critic.py's value model)."""

    def __init__(
        self,
        model: ModelConfig,
        optimizer: OptimizerConfig,
        actor: ActorConfig,
        world_size: int,
        rank: int,
        lr_decay_steps: int = 1000,
        hf_config: dict | None = None,
    ):
        """``hf_config``: build that architecture with random weights (seeded by model.seed) instead
        of loading model.path's. The process group must be initialised (runtime.init_distributed)."""
        if model.dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"model.dtype={model.dtype!r}: the fsdp backend takes float32 or bfloat16"
            )
        if (
            not dist.is_initialized()
            or dist.get_world_size() != world_size
            or dist.get_rank() != rank
        ):
            raise RuntimeError(
                f"FSDPModelManager(world_size={world_size}, rank={rank}) needs the default process "
                "group initialised with that size and rank "
                "(rlmega.process.distributed.init_distributed)"
            )
        if hf_config is None and not model.path:
            raise ValueError(
                "model.path is empty: the fsdp backend loads a Hugging Face folder from it"
            )
        self.model_cfg, self.optim_cfg, self.actor_cfg = model, optimizer, actor
        self.world_size, self.rank = world_size, rank
        self.lr_decay_steps = lr_decay_steps
        self.hf_config = hf_config
        cuda = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: LRSchedule | None = None
        self.grad_scaler = None
        self.offloaded: dict = {}
        self.last_step_taken = False  # whether the latest optimizer_step updated the weights
        # > 0: LoRA adapters on a frozen base (rlmega/learner/lora.py)
        self.lora_rank = actor.lora.rank
        # a VLM's frozen vision tower's parameter names (setup_model_and_optimizer)
        self.frozen_tower: set[str] = set()

    # ---- building ---------------------------------------------------------------------------
    def model_provider_func(self) -> torch.nn.Module:
        """The full model on the CPU in float32 (the master weights; bf16 is FSDP's compute cast).

        Attention: packed_attention.NAME, sdpa run once per sequence of a packed row (sequences
        read from position ids that restart, no attention_mask), causal within each sequence and
        nothing across, on CPU and GPU alike; transformers' own sdpa path would build a block mask
        over the whole row and compute all of its T^2 scores (43% of a CPU train step).
        """
        from transformers import AutoConfig

        if self.hf_config is not None:
            cfg = dict(self.hf_config)
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        else:
            config = AutoConfig.from_pretrained(self.model_cfg.path, local_files_only=True)
        # a VLM: AutoModelForImageTextToText, packed attention in its language model only
        auto_cls, kw = vision_inputs.load_kwargs(config, packed_attention.NAME)
        kw["dtype"] = torch.float32
        if self.hf_config is not None:
            with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left where it was
                torch.manual_seed(self.model_cfg.seed)
                model = auto_cls.from_config(config, **kw)
        else:
            model = auto_cls.from_pretrained(self.model_cfg.path, local_files_only=True, **kw)
        # linear-attention state restarts per packed sequence
        recurrent_layers.restart_at_sequences(model)
        return model

    def setup_model_and_optimizer(self, with_optimizer: bool = True) -> None:
        """Model (sharded), and with ``with_optimizer`` the AdamW, LR schedule and grad scaler."""
        model = self.model_provider_func()
        tied = (
            model.config.tie_word_embeddings
            if hasattr(model.config, "tie_word_embeddings")
            else False
        )
        if self.actor_cfg.activation_checkpointing:
            # transformers' own per-layer checkpointing (non-reentrant): it recomputes inside the
            # layer's __call__, so FSDP2's hooks on that layer gather its weights for the recompute;
            # parameter names stay HF's (a checkpoint_wrapper would add a prefix).
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        # A VLM's vision tower, frozen by default: out of the optimizer (requires_grad) and out of the syncs
        self.frozen_tower = (
            vision_inputs.vision_tower_names(model) if self.actor_cfg.freeze_vision_tower else set()
        )
        for name, p in model.named_parameters():
            if name in self.frozen_tower:
                p.requires_grad_(False)
        # peft's LoRA layers in place, everything else frozen (rlmega/learner/lora.py)
        if self.lora_rank:
            model = lora.add_adapters(model, self.actor_cfg.lora, self.model_cfg.seed)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = None
        if self.model_cfg.dtype == "bfloat16":
            # bf16 weights for compute, fp32 sharded master weights (the optimizer's) and fp32 gradient
            # reduction; log-probs and losses are the caller's, in fp32.
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        # the rest (embeddings, final norm, head; a tied head shares the embedding)
        fully_shard(model, **kw)
        if tied and model.get_output_embeddings() is not None:
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                raise RuntimeError("tied embeddings came apart in fully_shard")
        self.model = model
        # measured by the packing check a family outside the table must pass
        self.family_check_error = None
        if (
            self.model_cfg.allow_untested_family
            and family({"model_type": model.config.model_type}) is None
        ):
            err = self.family_check_error = family_check.check_packing(
                model, model.config.get_text_config().vocab_size, self.model_cfg.dtype
            )
            if self.rank == 0:
                print(
                    f"[rlmega] {type(model).__name__} is not in rlmega's tested families (model.allow_untested_family"
                    f"=true): its packed row gives each sequence's logits alone within {err:.2g}",
                    flush=True,
                )
        if not with_optimizer:
            return
        model.train()
        self.optimizer = self.build_optimizer(model)
        self.lr_scheduler = self.build_lr_scheduler(self.optimizer, self.optim_cfg)
        self.grad_scaler = self.build_grad_scaler(enabled=False)  # no fp16 in ModelConfig

    def build_optimizer(
        self, model: torch.nn.Module, enable_critic_warmup: bool = False
    ) -> torch.optim.AdamW:
        """AdamW over the sharded parameters with optimizer.{lr, weight_decay, adam_beta1/2, adam_eps}.
        ``enable_critic_warmup`` is RLinf's (a critic-only warm-up); rlmega's critic warms up by its own
        ``critic.warmup_steps`` (rlmega/fsdp/critic.py): must be False."""
        if enable_critic_warmup:
            raise ValueError(
                "enable_critic_warmup: rlmega's critic warms up by critic.warmup_steps instead"
            )
        o = self.optim_cfg
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
        )

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, optim_config: OptimizerConfig
    ) -> LRSchedule:
        """Megatron's schedule (rlmega/algorithms/lr_schedule.py): warm-up from 0 over lr_warmup_steps, then
        optimizer.lr_decay_style to min_lr at max(lr_decay_steps, warm-up + 1)."""
        o = optim_config
        return LRSchedule(
            optimizer, o.lr, o.min_lr, o.lr_warmup_steps, self.lr_decay_steps, o.lr_decay_style
        )

    def build_grad_scaler(self, enabled: bool, **kwargs):
        """torch's ShardedGradScaler (loss scaling for float16 training) when ``enabled``, else None.
        ModelConfig offers float32 and bfloat16 only (bf16 needs no loss scaling), so setup passes
        enabled=False; the scaled path exists for RLinf's API and is not exercised by tests."""
        if not enabled:
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)

    # ---- stepping ---------------------------------------------------------------------------
    def before_micro_batch(self, model: torch.nn.Module, is_last_micro_batch: bool) -> None:
        """Gradient accumulation: reduce-scatter gradients only in the last micro-batch's backward
        (earlier ones accumulate unsharded gradients locally), and keep the gathered weights
        between micro-batches instead of gathering them again for each."""
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(is_last_micro_batch)
        model.set_reshard_after_backward(is_last_micro_batch)

    def advance_lr_schedule(self, steps: int) -> None:
        """Move the schedule on by ``steps`` optimizer steps not taken here (Megatron's scheduler.step)."""
        self.lr_scheduler.step(steps)

    def _grad_norm(self) -> float:
        """The global L2 norm of all gradients: each rank's shards are disjoint, so the sum of squares
        over this rank's local shards, summed over ranks. The same float on every rank."""
        grads = [local_shard(p.grad) for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        dist.all_reduce(sq)
        return float(sq.sqrt())

    def optimizer_step(self, skip_nonfinite: bool = True, lr: float | None = None) -> StepResult:
        """Clip to optimizer.clip_grad, step, advance the schedule, zero the gradients.
        Returns StepResult(taken, grad_norm before clipping, the LR used), as MegatronModelManager's.

        ``lr`` overrides the schedule for this one step and leaves the schedule where it was. A
        non-finite norm (the same on every rank: it is global) skips the step everywhere, weights
        and Adam state unchanged, with ``skip_nonfinite``; without it every rank raises
        FloatingPointError, gradients zeroed. The step was taken iff the returned norm is finite (also
        ``self.last_step_taken``).
        """
        opt = self.optimizer
        scheduled = lr is None
        if scheduled:
            self.lr_scheduler.step(0)  # (re)apply the scheduled LR after an override
        else:
            for group in opt.param_groups:
                group["lr"] = lr
        lrs = [float(g["lr"]) for g in opt.param_groups]
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(opt)
        grad_norm = self._grad_norm()
        self.last_step_taken = math.isfinite(grad_norm)
        if not self.last_step_taken:
            opt.zero_grad(set_to_none=True)
            if self.grad_scaler is not None:
                self.grad_scaler.update()
            if not skip_nonfinite:
                raise FloatingPointError(f"non-finite grad norm {grad_norm}: step not taken")
            return StepResult(False, grad_norm, lrs[0])
        clip = self.optim_cfg.clip_grad
        coeff = clip / (grad_norm + 1.0e-6)  # Megatron's clip_grad_by_total_norm_fp32
        if clip > 0 and coeff < 1.0:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        local_shard(p.grad).mul_(coeff)
        if self.grad_scaler is not None:
            self.grad_scaler.step(opt)
            self.grad_scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduled:
            self.lr_scheduler.step(1)
        return StepResult(True, grad_norm, lrs[0])

    # ---- weights out ------------------------------------------------------------------------
    def get_model_state_dict(self, cpu_offload: bool = True, full_state_dict: bool = True) -> dict:
        """HF-named state dict: full tensors on rank 0 ({} elsewhere) with ``full_state_dict``, else
        this rank's DTensor shards. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model,
            options=StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload),
        )

    @torch.no_grad()
    def iter_full_tensors(
        self, weights: str = "merged", skip: set[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF checkpoint name, full tensor) of the plain model: under LoRA (rlmega/learner/lora.py) with the adapters
        merged into their layers (``weights`` "merged"), or the base alone ("base"). ``skip``: parameter names
        (named_parameters') left out; each still takes part in its all-gather on every rank."""
        if weights not in ("merged", "base"):
            raise ValueError(f"weights={weights!r}: choose 'merged' or 'base'")
        if not self.lora_rank:
            return self._checkpoint_layout(
                (n, t) for n, t in self.iter_model_tensors() if n not in skip
            )
        if weights == "base":
            return self._checkpoint_layout(
                lora.base_weights(self.iter_model_tensors(adapters=False))
            )
        return self._checkpoint_layout(
            lora.merged_weights(
                self.iter_model_tensors(), self.actor_cfg.lora.alpha / self.lora_rank
            )
        )

    def _checkpoint_layout(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors as the model's checkpoint stores them, which is what vLLM loads. transformers 5 converts
        some families' weights when it loads them (Mixtral's experts as one fused tensor under ``mlp.experts``,
        DeepSeek-V3's and Qwen3-Next's likewise) and converts them back when it saves; the in-memory names are
        not the checkpoint's (vLLM refuses Mixtral's: "no module or parameter named 'layers.0.mlp'"). Each
        parameter goes through transformers' own reverse conversion alone: measured exact, name and value,
        against the saved safetensors for every family of rlmega/config/families.py (tests/unit/test_families.py)."""
        from transformers.core_model_loading import revert_weight_conversion

        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        for name, tensor in tensors:
            yield from revert_weight_conversion(model, {name: tensor}).items()

    @torch.no_grad()
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters, full, by PEFT's saved names, on every rank (on the host). At world 1 they are the
        live parameters (engine_api: valid until the next update). Collective."""
        if not self.lora_rank:
            raise NotImplementedError("this model has no LoRA adapters (actor.lora.rank=0)")
        return {
            k: v.detach().cpu()
            for k, v in lora.adapter_weights(self.iter_model_tensors(base=False))
        }

    @torch.no_grad()
    def iter_model_tensors(
        self, base: bool = True, adapters: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full float tensor on this rank's device) per parameter, in named_parameters order (a tied
        head is skipped, as HF stores the embedding once), then the persistent buffers (``base``): checkpoint state
        that is not trained, DeepSeek-V3's router bias ``e_score_correction_bias``, which vLLM loads together with
        its router's weight (a sync without it waited for it, refused). HF names, peft's under LoRA (``base`` /
        ``adapters`` False: without those). Collective: every rank iterates it to the end and gets every tensor;
        only one parameter's full tensor is gathered at a time."""
        for name, p in self.model.named_parameters():
            if adapters if lora.is_adapter(name) else base:
                yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        if base:
            for prefix, module in self.model.named_modules():
                for name, b in module._buffers.items():
                    if b is not None and name not in module._non_persistent_buffers_set:
                        yield f"{prefix}.{name}" if prefix else name, b.detach()

    # ---- offload (each kind separately; storages freed and refilled, rlmega/learner/offload.py) ------
    def _offload(self, kind: str, tensors: list[torch.Tensor]) -> None:
        if kind in self.offloaded:
            raise RuntimeError(f"{kind} are already offloaded; load them first")
        self.offloaded[kind] = offload.offload_tensors(tensors)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed blocks back to the device

    def _onload(self, kind: str, device_id) -> None:
        if kind not in self.offloaded:
            raise RuntimeError(f"{kind} are not offloaded")
        if (
            device_id is not None
            and torch.device(
                device_id if not isinstance(device_id, int) else f"cuda:{device_id}"
            ).type
            != self.device.type
        ):
            raise ValueError(f"device_id={device_id}: the model lives on {self.device}")
        offload.onload_tensors(self.offloaded.pop(kind))  # back into the same storages, same device

    def _params(self) -> list[torch.Tensor]:
        return [local_shard(p) for p in self.model.parameters()]

    def _grads(self) -> list[torch.Tensor]:
        return [local_shard(p.grad) for p in self.model.parameters() if p.grad is not None]

    def _optimizer_state(self) -> list[torch.Tensor]:
        return [
            local_shard(v)
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        ]

    def offload_param_and_grad(self, offload_grad: bool = False) -> None:
        """This rank's parameter shards (and gradients, with ``offload_grad``) to host memory."""
        self._offload("params", self._params())
        if offload_grad:
            self._offload("grads", self._grads())

    def load_param_and_grad(self, device_id=None, load_grad: bool = False) -> None:
        self._onload("params", device_id)
        if load_grad and "grads" in self.offloaded:
            self._onload("grads", device_id)

    def offload_optimizer(self) -> None:
        """Adam's moments (and step counters) of this rank's shards to host memory."""
        self._offload("optimizer state", self._optimizer_state())

    def load_optimizer(self, device_id=None) -> None:
        self._onload("optimizer state", device_id)

    # ---- checkpoints and export -------------------------------------------------------------
    def save_checkpoint(
        self,
        save_path: str | Path,
        step: int,
        extra: dict | None = None,
        extra_models: dict | None = None,
    ) -> Path:
        """Sharded DCP checkpoint of model, optimizer, schedule and RNG (fsdp/checkpoint.py). Collective.
        ``extra_models``: name -> FSDPModelManager or FSDP2 model saved alongside (the reference)."""
        return checkpoint.save(
            save_path,
            step,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            extra,
            _models(extra_models),
            lora=checkpoint_record(self.actor_cfg.lora),
        )

    def load_checkpoint(
        self, load_path: str | Path, model_only: bool = False, extra_models: dict | None = None
    ) -> tuple[int, dict]:
        """Everything, or with ``model_only`` just the weights; any world size. Returns (step, extra)."""
        # The config wins over the checkpoint's optimizer settings (lr, betas, eps, weight decay), as
        # for Megatron: loading replaces the param groups' values, so they are put back (only Adam's
        # state and the schedule's step count come from the checkpoint).
        opt = None if model_only else self.optimizer
        settings = (
            []
            if opt is None
            else [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        )
        step, extra = checkpoint.load(
            load_path,
            self.model,
            opt,
            None if model_only else self.lr_scheduler,
            _models(extra_models),
            lora=checkpoint_record(self.actor_cfg.lora),
        )
        for group, mine in zip(opt.param_groups if opt is not None else [], settings):
            group.update(mine)
        if opt is not None:
            self.lr_scheduler.step(0)  # the restored step count's LR under the config's schedule
        return step, extra

    def export_hf(self, out_dir: str | Path, overwrite: bool = False) -> Path:
        """Write the model as a plain HF folder (model.safetensors, config.json, tokenizer and generation
        files of model.path) that AutoModelForCausalLM.from_pretrained loads; under LoRA a PEFT adapter folder
        (adapter_config.json naming model.path, adapter_model.safetensors, the tokenizer) that
        peft.PeftModel.from_pretrained loads onto model.path, with the merged model as a plain HF folder in
        ``merged/``. Collective; rank 0 writes into ``out_dir.partial`` and renames it into place."""
        out_dir = Path(out_dir)
        # every rank sees it: no hang
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
        full = self.get_model_state_dict(cpu_offload=True, full_state_dict=True)
        # a VLM is rebuilt by its own auto class (rlmega/fsdp/vision_inputs.py)
        auto_class = (
            vision_inputs.VLM_AUTO_CLASS
            if vision_inputs.is_vlm(self.model.config)
            else self.AUTO_CLASS
        )
        if self.rank == 0:
            partial = out_dir.with_name(out_dir.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            if self.lora_rank:
                # a PEFT adapter folder (peft loads it onto model.path), and the merged model in merged/
                cfg = self.actor_cfg.lora
                lora.write_adapter(
                    str(partial),
                    cfg,
                    dict(lora.adapter_weights(full.items())),
                    str(Path(self.model_cfg.path).resolve()),
                )
                full = dict(lora.merged_weights(full.items(), cfg.alpha / cfg.rank))
                merged = partial / "merged.partial"
                _cpu_copy(self.model.config, full, auto_class).save_pretrained(
                    merged, safe_serialization=True
                )
                finish_export(merged, partial / "merged", Path(self.model_cfg.path))
            else:
                _cpu_copy(self.model.config, full, auto_class).save_pretrained(
                    partial, safe_serialization=True
                )
            finish_export(
                partial, out_dir, Path(self.model_cfg.path) if self.model_cfg.path else None
            )
        dist.barrier()
        return out_dir


def _models(extra: dict | None) -> dict | None:
    # only a manager is unwrapped: an HF model's .model is its inner decoder (no lm_head)
    return (
        None
        if extra is None
        else {k: v.model if isinstance(v, FSDPModelManager) else v for k, v in extra.items()}
    )


def _cpu_copy(config, state: dict, auto_class: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """A plain (unsharded) CPU model of ``config`` (built by transformers' ``auto_class``) holding
    ``state``; save_pretrained stores a tied head once, as HF does."""
    import transformers

    config = type(config).from_dict(config.to_dict())
    config.use_cache = True  # gradient checkpointing turned it off on the training model
    model = getattr(transformers, auto_class).from_config(
        config, dtype=next(iter(state.values())).dtype
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not _tied_head(model, k)]:
        raise RuntimeError(
            f"export: state dict does not match {type(model).__name__}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return model


def _tied_head(model, key: str) -> bool:
    out = model.get_output_embeddings()
    return (
        out is not None
        and key.endswith("weight")
        and out.weight is model.get_input_embeddings().weight
    )
