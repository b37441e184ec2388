"""Mixture-of-experts config checks (issue 24): expert parallelism, router losses, routing replay, the MoE
configs. No processes, no weights except the tiny MoE the moe_cpu config test makes; megatron-core's own
expert-grid rule runs on fake process groups."""

import json
import os
import re

import pytest

from rlmega.config import ConfigError, RLConfig, load_config, validate
from test_config import REPO, rejects, write_model  # pytest puts tests/unit on sys.path


def write_moe_model(tmp_path, experts=8, topk=2, key="num_experts", name="moe"):
    """config.json of a tiny Qwen3-MoE (heads 4/2, hidden 256, 4 layers). transformers 5 writes the expert
    count as num_local_experts; Qwen's published files (Qwen3-30B-A3B) as num_experts: both are read."""
    folder = write_model(tmp_path, name=name)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf.update(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            key: experts,
            "num_experts_per_tok": topk,
            "moe_intermediate_size": 64,
        }
    )
    with open(path, "w") as f:
        json.dump(hf, f)
    return folder


MOE = ["parallelism.world_size=4", "trainer.prompts_per_step=4", "trainer.global_batch_size=16"]


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_moe_settings_load_for_an_moe_model(tmp_path, key):
    model = write_moe_model(tmp_path, key=key)
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            *MOE,
            "parallelism.expert_model_parallel_size=4",
            "algorithm.routing_replay=rollout",
            "actor.moe_aux_loss_coeff=0.001",
            "actor.moe_z_loss_coeff=0.001",
        ],
    )
    assert (
        cfg.parallelism.expert_model_parallel_size == 4
        and cfg.algorithm.routing_replay == "rollout"
    )
    cfg = load_config()
    assert (
        cfg.parallelism.expert_model_parallel_size,
        cfg.algorithm.routing_replay,
        cfg.actor.moe_aux_loss_coeff,
        cfg.actor.moe_z_loss_coeff,
    ) == (1, "none", 0.0, 0.0)


def test_experts_must_split_over_ep_ranks(tmp_path):
    model = write_moe_model(tmp_path, experts=6)
    msg = rejects(
        f"model.path={model}",
        *MOE,
        "parallelism.expert_model_parallel_size=4",
        field="parallelism.expert_model_parallel_size",
    )
    assert "num_experts=6" in msg and "DP = world_size / (TP x PP) = 4: [1, 2]" in msg


def test_world_size_must_be_a_multiple_of_tp_ep_pp():
    # DP = 8 / (2 x 2) = 2: EP 4 does not fit the expert grid (8 % 16), EP 2 does
    msg = rejects(
        "parallelism.world_size=8",
        "parallelism.tensor_model_parallel_size=2",
        "parallelism.pipeline_model_parallel_size=2",
        "parallelism.expert_model_parallel_size=4",
        "trainer.prompts_per_step=4",
        field="parallelism.expert_model_parallel_size",
    )
    assert "TP x EP x PP = 2 x 4 x 2 = 16" in msg and "divides 2: [1, 2]" in msg
    rejects(
        "parallelism.expert_model_parallel_size=0", field="parallelism.expert_model_parallel_size"
    )


def test_an_moe_model_trains_at_tp_2_only_under_sequence_parallelism(tmp_path):
    """megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism (issue 24 refused
    MoE at TP > 1; issue 40 turned SP on at TP > 1 and split routes by sequence): SP off is refused at load."""
    model = write_moe_model(tmp_path)
    # SP: null -> on
    load_config(None, [f"model.path={model}", *MOE, "parallelism.tensor_model_parallel_size=2"])
    msg = rejects(
        f"model.path={model}",
        *MOE,
        "parallelism.tensor_model_parallel_size=2",
        "parallelism.sequence_parallel=false",
        field="parallelism.sequence_parallel",
    )
    assert "only under sequence parallelism" in msg
    dense = write_model(tmp_path, name="dense")
    load_config(
        None,
        [
            f"model.path={dense}",
            *MOE,
            "parallelism.tensor_model_parallel_size=2",
            "parallelism.sequence_parallel=false",
        ],
    )  # dense: fine


def test_the_expert_grid_rule_is_megatron_cores():
    """validate's rule (world_size % (TP x EP x PP) == 0, expert TP = TP) against megatron-core 0.16's own
    initialize_model_parallel, run on a fake process group of each world size (no processes): the same
    layouts pass and fail (75 layouts; 0 disagree)."""
    import warnings

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Transformer Engine / apex here
        from megatron.core import parallel_state as ps

    def megatron_takes(world, tp, ep, pp):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                create_gloo_process_groups=False,
            )
            return True
        except RuntimeError as e:
            assert "expert_tensor_model_pipeline_parallel" in str(e), e
            return False
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()

    def rlmega_takes(world, tp, ep, pp):
        cfg = RLConfig()
        p = cfg.parallelism
        p.world_size, p.tensor_model_parallel_size, p.expert_model_parallel_size = world, tp, ep
        p.pipeline_model_parallel_size = pp
        cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.trainer.global_batch_size = 16, 2, 32
        try:
            validate(cfg)
            return True
        except ConfigError as e:
            assert all(
                q.startswith("parallelism.expert_model_parallel_size:") for q in e.problems
            ), e
            return False

    layouts = [
        (w, tp, ep, pp)
        for w in (4, 6, 8, 16)
        for tp in (1, 2)
        for ep in (1, 2, 3, 4, 8)
        for pp in (1, 2)
        if w % (tp * pp) == 0
    ]
    assert len(layouts) == 75
    verdicts = [(megatron_takes(*lay), rlmega_takes(*lay)) for lay in layouts]
    assert [lay for lay, (m, r) in zip(layouts, verdicts) if m != r] == []
    assert sum(m for m, _ in verdicts) == 42  # 42 taken, 33 refused: the comparison can fail


@pytest.mark.parametrize(
    "setting",
    [
        "parallelism.expert_model_parallel_size=2",
        "algorithm.routing_replay=trainer",
        "algorithm.routing_replay=rollout",
        "actor.moe_aux_loss_coeff=0.01",
        "actor.moe_z_loss_coeff=0.001",
    ],
)
def test_moe_settings_are_refused_for_a_dense_model(tmp_path, setting):
    model = write_model(tmp_path)
    msg = rejects(f"model.path={model}", *MOE, setting, field=setting.split("=")[0])
    assert "is a dense model" in msg


@pytest.mark.parametrize(
    "setting",
    [
        "parallelism.expert_model_parallel_size=2",
        "algorithm.routing_replay=rollout",
        "actor.moe_aux_loss_coeff=0.01",
        "actor.moe_z_loss_coeff=0.001",
    ],
)
def test_moe_settings_are_refused_for_the_fsdp_learner(tmp_path, setting):
    model = write_moe_model(tmp_path)
    msg = rejects(
        f"model.path={model}", *MOE, "actor.backend=fsdp", setting, field=setting.split("=")[0]
    )
    assert "actor.backend=fsdp trains an MoE model through transformers' own MoE layers" in msg
    assert msg.count("Fix:") == 1  # only this problem


@pytest.mark.parametrize("coeff", ["actor.moe_aux_loss_coeff", "actor.moe_z_loss_coeff"])
@pytest.mark.parametrize(
    "value, says",
    [
        ("-0.1", "must be >= 0"),
        ("nan", "is not a finite number"),
        ("inf", "is not a finite number"),
    ],
)
def test_router_loss_coefficients_are_finite_and_not_negative(coeff, value, says):
    assert says in rejects(f"{coeff}={value}", field=coeff)


def test_moe_config_json_with_impossible_experts_is_refused(tmp_path):
    model = write_moe_model(tmp_path, experts=4, topk=8)
    assert "num_experts_per_tok=8" in rejects(f"model.path={model}", field="model.path")
    model = write_moe_model(tmp_path, experts="8", name="moe_text")
    assert "num_experts='8'" in rejects(f"model.path={model}", field="model.path")


def test_moe_cpu_config_passes_every_check_and_the_weights_are_checked_per_expert(tmp_path):
    """configs/moe_cpu.yaml on the tiny Qwen3-MoE its header says to make: valid and runnable here (the
    preflight reads every expert's safetensors header against config.json); a config.json whose expert
    width or count disagrees with the weights is refused naming the tensors."""
    from rlmega.preflight import preflight
    from rlmega.demo.tiny_model import make_tiny_model

    model = make_tiny_model(
        tmp_path / "moe",
        arch="qwen3_moe",
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        num_layers=4,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=128,
        seed=0,
    )
    moe = os.path.join(REPO, "configs", "moe_cpu.yaml")
    base = [f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}"]
    cfg = load_config(moe, base)
    par = cfg.parallelism
    assert (
        par.world_size,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.expert_model_parallel_size,
        cfg.algorithm.routing_replay,
    ) == (2, 1, 1, 2, "rollout")
    preflight(cfg)
    hf = json.loads((model / "config.json").read_text())
    for change, says in (
        (
            {"moe_intermediate_size": 64},
            "mlp.experts.0.gate_proj.weight [128, 256] (config.json implies [64, 256])",
        ),
        (
            {"num_local_experts": 4, "num_experts": 4},
            "does not have: model.layers.0.mlp.experts.4.",
        ),
    ):
        (model / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(ConfigError, match=r"model.path: .*" + re.escape(says)):
            preflight(load_config(moe, base))
