"""MegatronModelManager: one trainer rank's Megatron model, optimizer, schedule and state.

    init_megatron(tp, pp, vpp, seed, ep=1)                 # rlmega.megatron.runtime
    mm = MegatronModelManager(cfg.model, cfg.parallelism, cfg.optimizer, lr_decay_steps=100)
    mm.setup_model_and_optimizer()                         # chunks + HF weights + DDP + optimizer
    ... forward/backward through get_forward_backward_func(model=mm.model) ...
    ok, grad_norm, lr = mm.optimizer_step()
    mm.save_checkpoint("runs/x/ckpt", step=1)              # atomic, Megatron dist checkpointing
    mm.offload_optimizer_state(); mm.onload_optimizer_state()

The model is a list of chunks, one per virtual pipeline stage this rank holds (one without
VPP), each wrapped in Megatron DDP once the optimizer is set up. Names follow RLinf's manager.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Iterable

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from rlmega.learner import lora as lora_files
from rlmega.config.gemma3_layout import gemma3_layout
from rlmega.config.lora_rules import checkpoint_record
from rlmega.config.schema import LoraConfig, ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.config.value_model import VALUE_HEAD, fresh_value_head, head_std, value_model_config
from rlmega.learner.engine_api import StepResult
from rlmega.megatron import checkpoint, gemma3, lora_adapters, mla, offload
from rlmega.megatron.hf_config import ModelShape, check_expert_layout, megatron_config_from_hf
from rlmega.megatron.hf_io import export_hf, load_hf_weights, read_hf_config, unwrap
from rlmega.megatron.norms import HeadRMSNorm, TokenRMSNorm, ZeroCenteredTokenRMSNorm
from rlmega.megatron.packed_attention import PackedSDPAttention
from rlmega.megatron.value_head import ValueHead
from rlmega.rundir.checkpoint_files import finish_export

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def layer_spec(use_te: bool, shape: ModelShape | None = None):
    """Transformer Engine's layer spec on a GPU when TE is importable; the local spec with rlmega's
    ``PackedSDPAttention`` otherwise (forward it with ``packed_attention.packed_rows``).

    ``shape`` adds Qwen3's q/k norms and MoE layers (the local spec's SequentialMLP experts:
    ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight``; TE's grouped experts:
    ``mlp.experts.linear_fc{1,2}.weight{j}``; hf_weights maps both)."""
    qk_norm = bool(shape and shape.qk_norm)
    experts = shape.num_experts if shape is not None and shape.is_moe else None
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=qk_norm
        )
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    # torch's RMSNorm marked for sequence parallelism (megatron-core's WrappedTorchNorm refuses it): norms.py
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = TokenRMSNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = (
            layer.self_attention.submodules.k_layernorm
        ) = HeadRMSNorm
    # fused SDPA per packed sequence (and RoPE without cats) instead of DotProductAttention's
    # materialised, unfused (B*heads, S, S) scores: rlmega/megatron/packed_attention.py
    spec.submodules.self_attention.submodules.core_attention = PackedSDPAttention
    return spec


def transformer_engine_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# (kind, offload method, onload method) of MegatronModelManager, in offload order: what a colocated
# trainer (MegatronActor) or critic (MegatronCritic) releases while the engines generate.
PHASE_KINDS = (
    ("grads", "offload_grads", "onload_grads"),
    ("optimizer state", "offload_optimizer_state", "onload_optimizer_state"),
    ("main params", "offload_megatron_copy_params", "load_megatron_copy_params"),
    ("params", "offload_params", "onload_params"),
)


def make_data_iterator_list(data_iterator: Iterable, padding: bool = False, vpp_size: int = 1):
    """The data iterator megatron-core's pipeline schedule takes: with virtual pipeline stages
    (``vpp_size`` > 1) a list of one iterator per model chunk, each over every micro-batch (each chunk
    pulls each one in turn), else one iterator. ``padding``: each dict micro-batch gets
    "max_batch_seqlen", the longest row over all of them (the schedule's ``seq_length``; with VPP the
    rows in flight share that length). The one place that builds it (MegatronModelManager's
    ``make_data_iterator_list``, rlmega/megatron/pipeline_passes.py and lm_step.py)."""
    micro_batches = list(data_iterator)
    if padding:
        longest = max(
            (mb["tokens"].shape[-1] for mb in micro_batches if isinstance(mb, dict)), default=0
        )
        for mb in micro_batches:
            if isinstance(mb, dict):
                mb["max_batch_seqlen"] = longest
    return [iter(micro_batches) for _ in range(vpp_size)] if vpp_size > 1 else iter(micro_batches)


class MegatronModelManager:
    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelismConfig,
        optimizer: OptimizerConfig,
        lr_decay_steps: int = 1000,
        hf_config: dict | None = None,
        moe_aux_loss_coeff: float = 0.0,
        moe_z_loss_coeff: float = 0.0,
        routing_replay: bool = False,
        value_head: bool = False,
        lora: LoraConfig | None = None,
        moe_router_bias_update_rate: float = 0.0,
    ):
        """``hf_config`` overrides reading ``model.path/config.json`` (a model built from scratch).

        ``value_head``: a critic (rlmega/megatron/critic.py): the output layer is hidden -> 1 (ValueHead,
        HF ``score.weight``); model.path may be a critic's export or a causal LM, whose body it takes
        with a fresh head (rlmega.config.value_model), and an export writes the critic's config.

        MoE models: expert parallelism comes from ``parallel.expert_model_parallel_size`` (must match
        ``init_megatron(ep=...)``); ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` / ``moe_router_bias_update_rate``
        (actor section) and
        ``routing_replay`` (megatron's ``moe_enable_routing_replay``: a RouterReplay hook on every router;
        MegatronActor always asks for it, its hook routes live unless told otherwise, routing_replay.py)
        go to the TransformerConfig. All are ignored for dense models (EP > 1 is refused).

        ``lora`` (actor.lora, rank > 0): LoRA adapters on a frozen base (lora_adapters.py), added once the
        weights are in; ``self.adapters`` maps each adapted weight to its adapters ({} without)."""
        self.model_cfg, self.parallel, self.optim_cfg = model, parallel, optimizer
        self.lr_decay_steps = lr_decay_steps
        self.hf_config = hf_config if hf_config is not None else read_hf_config(model.path)
        if value_head:
            # a causal LM's config becomes its critic's
            self.hf_config = value_model_config(self.hf_config)
        self.dtype = _DTYPES[model.dtype]
        self.use_te = transformer_engine_usable()
        vpp = parallel.virtual_pipeline_model_parallel_size
        self.vpp = vpp if vpp and vpp > 1 else 1
        self.ep = parallel.expert_model_parallel_size
        self.shape = ModelShape.from_hf(self.hf_config, parallel.tensor_model_parallel_size)
        mtp = int(self.hf_config.get("num_nextn_predict_layers") or 0) if self.shape.mla else 0
        if mtp and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(
                f"[rlmega] {self.shape.architecture}: the checkpoint's {mtp} multi-token-prediction layer(s) "
                f"(model.layers.{self.shape.num_layers}.*) are dropped, as transformers drops them: RL trains "
                "the next-token model, and the export says num_nextn_predict_layers: 0",
                flush=True,
            )
        check_expert_layout(
            self.shape,
            self.ep,
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
        )
        if (
            ps.model_parallel_is_initialized()
            and ps.get_expert_model_parallel_world_size() != self.ep
        ):
            raise ValueError(
                f"parallelism.expert_model_parallel_size={self.ep} but Megatron was initialised with EP "
                f"{ps.get_expert_model_parallel_world_size()}: pass ep= to init_megatron"
            )
        self.transformer_config, self.gpt_kwargs = megatron_config_from_hf(
            self.hf_config,
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            self.vpp,
            self.dtype,
            cpu=not torch.cuda.is_available(),
            ep=self.ep,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_z_loss_coeff=moe_z_loss_coeff,
            routing_replay=routing_replay,
            moe_router_bias_update_rate=moe_router_bias_update_rate,
            grouped_gemm=self.use_te,
            sequence_parallel=parallel.sequence_parallel_on,
            context_parallel=parallel.context_parallel_size,
        )
        if parallel.context_parallel_size > 1 and self.use_te:
            raise ValueError(
                "parallelism.context_parallel_size > 1 runs with rlmega's attention (the local layer "
                "spec, rlmega/megatron/context_parallel.py); with Transformer Engine installed its THD "
                "context-parallel path is not wired up yet: set context_parallel_size=1"
            )
        self.lora = lora if lora is not None and lora.rank else None
        self.adapters: dict = {}
        self.model: list = []
        self.optimizer = None
        self.scheduler = None
        self.offloaded: dict = {}

    # ---- building ---------------------------------------------------------------------------
    def model_provider_func(
        self, pre_process: bool, post_process: bool, vp_stage: int | None = None
    ) -> GPTModel:
        """One model chunk; pre_process holds the embedding, post_process the output head (a critic's:
        the value head, seeded as rlmega.config.value_model.fresh_value_head until weights load)."""
        # DeepSeek-V3: per-layer specs (dense first layers), multi-latent attention: mla.py
        if self.shape.mla:
            if self.use_te:
                raise ValueError(
                    "DeepSeek-V3 (multi-latent attention) on Transformer Engine's layer spec is not built "
                    "yet: rlmega builds it on the local spec (docs/deepseek_v3_megatron.md)"
                )
            spec = mla.decoder_block_spec(self.transformer_config, vp_stage)
        elif self.shape.gemma3:  # post-norms, norms centred on 0, windows: gemma3.py
            if self.use_te:
                raise ValueError(
                    "Gemma 3 on Transformer Engine's layer spec is not built yet: rlmega builds it on "
                    "the local spec (rlmega/megatron/gemma3.py)"
                )
            spec = gemma3.layer_spec()
        else:
            spec = layer_spec(self.use_te, self.shape)
        # the block's final norm too (megatron-core: WrappedTorchNorm)
        if not self.use_te and not self.shape.mla:
            spec = TransformerBlockSubmodules(
                layer_specs=[spec]
                * get_num_layers_to_build(self.transformer_config, vp_stage=vp_stage),
                layer_norm=ZeroCenteredTokenRMSNorm if self.shape.gemma3 else TokenRMSNorm,
            )
        model = GPTModel(
            config=self.transformer_config,
            transformer_layer_spec=spec,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            **self.gpt_kwargs,
        )
        if self.shape.mla:
            mla.count_expert_tokens(model)
        if self.shape.gemma3:
            layout = gemma3_layout(self.hf_config)
            gemma3.finish_model(
                model,
                layout.embedding_scale,
                layout.sliding_theta if any(layout.sliding) else None,
                layout.global_linear_factor,
            )
        if post_process and self.shape.value_head:
            model.output_layer = ValueHead(
                self.shape.hidden_size,
                self.dtype,
                sequence_parallel=self.transformer_config.sequence_parallel,
            )
            with torch.no_grad():
                model.output_layer.weight.copy_(self.fresh_head())
        return model

    def fresh_head(self) -> torch.Tensor:
        """A critic's value head before training, when its folder has none (both backends draw it alike)."""
        return fresh_value_head(
            self.shape.hidden_size, head_std(self.hf_config), self.model_cfg.seed
        )

    def build_model_chunks(self) -> list[torch.nn.Module]:
        """This rank's chunks: GPTModel, wrapped in Float16Module for bf16."""
        chunks = []
        for i in range(self.vpp):
            stage = i if self.vpp > 1 else None
            chunks.append(
                self.model_provider_func(
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                    vp_stage=stage,
                )
            )
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        if self.transformer_config.bf16:
            # Megatron's mixed precision (as its get_model does): bf16 parameters and compute, inputs
            # cast on the first stage, logits handed back in fp32 on the last. The optimizer keeps fp32
            # main params (bf16=True below) and DDP reduces grads in fp32; log-probs and losses are fp32.
            chunks = [Float16Module(self.transformer_config, c) for c in chunks]
        return chunks

    def setup_model_and_optimizer(
        self, load_weights: bool = True, with_optimizer: bool = True
    ) -> None:
        """Chunks (HF weights loaded when model.path is set), DDP, optimizer and LR schedule."""
        chunks = self.build_model_chunks()
        if load_weights and self.model_cfg.path:
            fresh = {VALUE_HEAD: self.fresh_head()} if self.shape.value_head else None
            load_hf_weights(chunks, self.model_cfg.path, shape=self.shape, missing=fresh)
        if self.lora:  # before DDP: its buffers and the optimizer take the adapters alone
            self.adapters = lora_adapters.add_adapters(
                chunks,
                self.lora,
                self.shape,
                self.model_cfg.seed,
                sequence_parallel=self.transformer_config.sequence_parallel,
            )
        if not with_optimizer:
            self.model = chunks
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=self.optim_cfg.use_distributed_optimizer,
        )
        # Only the first chunk buckets its grads; the schedule issues the others' reductions in
        # order, as Megatron's own get_model does.
        self.model = [
            DistributedDataParallel(self.transformer_config, ddp_config, c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        o = self.optim_cfg
        self.optimizer = get_megatron_optimizer(
            McoreOptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                use_distributed_optimizer=o.use_distributed_optimizer,
                params_dtype=self.dtype,
                bf16=self.dtype == torch.bfloat16,
            ),
            self.model,
        )
        decay_steps = max(self.lr_decay_steps, o.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
            # On resume the config's schedule wins over the checkpoint's (only the step count is taken
            # from it): config.yaml records the new values, and a longer trainer.total_steps must
            # stretch the decay. The driver logs what changed (rlmega/rundir/run.py: changed_settings).
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    # ---- stepping ---------------------------------------------------------------------------
    def optimizer_step(self, skip_nonfinite: bool = True, lr: float | None = None) -> StepResult:
        """Clip, step and advance the LR schedule. Returns StepResult(taken, grad_norm, lr used).

        ``lr`` overrides the schedule for this one step and leaves the schedule where it was
        (a warm start outside the RL schedule); the next scheduled step restores the scheduled LR.

        The grad norm is global (all model-parallel and data-parallel ranks), so a NaN or inf
        anywhere gives every rank the same non-finite norm and the same decision: with
        ``skip_nonfinite`` the step is skipped everywhere, parameters and Adam state unchanged;
        without it every rank raises FloatingPointError before touching the parameters.
        (Megatron itself only checks this with an fp16 loss scaler.)
        """
        opt = self.optimizer
        scheduled = lr is None
        if scheduled:
            self.scheduler.step(increment=0)  # (re)apply the scheduled LR and weight decay
        else:
            for group in opt.param_groups:
                group["lr"] = lr
        lr = float(opt.param_groups[0]["lr"])
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.zero_grad()
            if not skip_nonfinite:
                raise FloatingPointError(f"non-finite grad norm {grad_norm}: step not taken")
            return StepResult(False, grad_norm, lr)
        if self.optim_cfg.clip_grad > 0:
            for inner in getattr(opt, "chained_optimizers", [opt]):
                params = inner.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params, max_norm=self.optim_cfg.clip_grad, total_norm=grad_norm
                    )
        ok = opt.step_with_ready_grads()
        if ok and scheduled:
            self.scheduler.step(increment=1)
        return StepResult(bool(ok), grad_norm, lr)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients: DDP's buffers (each parameter's main_grad) and the optimizer's
        (the next train pass zeroes the buffers too; a skipped step leaves nothing behind it either way)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ---- offload (each kind separately; see offload.py) --------------------------------------
    def _offload(self, kind: str, tensors) -> None:
        if kind in self.offloaded:
            raise RuntimeError(f"{kind} are already offloaded; onload them first")
        self.offloaded[kind] = offload.offload_tensors(tensors)

    def _onload(self, kind: str) -> None:
        if kind not in self.offloaded:
            raise RuntimeError(f"{kind} are not offloaded")
        offload.onload_tensors(self.offloaded.pop(kind))

    def offload_params(self):
        self._offload("params", offload.model_params(self.model))

    def onload_params(self):
        self._onload("params")

    def offload_grads(self):
        self._offload("grads", offload.model_grads(self.model))

    def onload_grads(self):
        self._onload("grads")

    def offload_optimizer_state(self):
        self._offload("optimizer state", offload.optimizer_state(self.optimizer))

    def onload_optimizer_state(self):
        self._onload("optimizer state")

    def offload_megatron_copy_params(self):
        self._offload("main params", offload.main_params(self.optimizer))

    def load_megatron_copy_params(self):
        self._onload("main params")

    # ---- checkpoints and export -------------------------------------------------------------
    def save_checkpoint(
        self,
        ckpt_dir: str | Path,
        step: int,
        extra: dict | None = None,
        extra_models: dict[str, list] | None = None,
    ) -> Path:
        return checkpoint.save(
            ckpt_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            extra,
            extra_models,
            lora=checkpoint_record(self.lora) if self.lora else None,
        )

    def load_checkpoint(
        self,
        ckpt_dir: str | Path,
        model_only: bool = False,
        extra_models: dict[str, list] | None = None,
    ) -> tuple[int, dict]:
        """Everything (at the saved PP, TP and EP; DP and CP may differ), or with ``model_only`` just the
        weights (any layout)."""
        # Loading the optimizer replaces its param groups' settings (max_lr, min_lr, Adam's betas and
        # eps, ...) with the checkpoint's; the config's win, as for the LR schedule, so they are put
        # back (keys the load adds, such as Adam's step, stay).
        settings = (
            []
            if model_only or self.optimizer is None
            else [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
        )
        step, extra = checkpoint.load(
            ckpt_dir,
            self.model,
            None if model_only else self.optimizer,
            None if model_only else self.scheduler,
            extra_models,
            lora=checkpoint_record(self.lora) if self.lora else None,
        )
        for group, mine in zip(self.optimizer.param_groups if settings else [], settings):
            group.update(mine)
        if model_only and self.optimizer is not None:
            self.optimizer.reload_model_params()  # bf16: refresh the fp32 master copies
        return step, extra

    def export_hf(self, out_dir: str | Path, overwrite: bool = False) -> Path:
        """An HF folder of the model; under LoRA a PEFT adapter folder (adapter_config.json naming model.path,
        adapter_model.safetensors, the tokenizer) that peft.PeftModel.from_pretrained loads onto model.path,
        with the merged model as a plain HF folder in ``merged/``. Collective."""
        if not self.lora:
            return export_hf(
                self.model,
                out_dir,
                source=self.model_cfg.path,
                overwrite=overwrite,
                hf_config=self.hf_config if self.shape.value_head else None,
            )
        out_dir, source = Path(out_dir), Path(self.model_cfg.path)
        # every rank sees it: no hang
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
        partial = out_dir.with_name(out_dir.name + ".partial")
        tensors = lora_adapters.adapter_tensors(self.adapters)
        first = torch.distributed.get_rank() == 0
        if first:
            shutil.rmtree(partial, ignore_errors=True)
            lora_files.write_adapter(str(partial), self.lora, tensors, str(source.resolve()))
        torch.distributed.barrier()
        export_hf(self.model, partial / "merged", source=source, merge=self.adapters)
        if first:
            finish_export(partial, out_dir, source)
        torch.distributed.barrier()
        return out_dir

    def make_data_iterator_list(
        self, data_iterator: Iterable, padding: bool = False, vpp_size: int | None = None
    ):
        """``make_data_iterator_list`` for this manager's chunks (``vpp_size`` None: the model's own)."""
        return make_data_iterator_list(
            data_iterator, padding, self.vpp if vpp_size is None else vpp_size
        )

    def unwrapped(self) -> list[GPTModel]:
        return [unwrap(c) for c in self.model]
