"""A model judge's engine gets its own device and context from its config, checked at load, and its
failures are counted per judger (issue 22 item 16). No engine starts here (tests/e2e/test_judgers_ray.py
runs one)."""

import json

import pytest

from rlmega.agents.placement import judger_bundles
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup
from rlmega.config.judger_rules import validate_judgers
from rlmega.config.schema import JudgerConfig, RewardConfig
from rlmega.judgers.model import engine_settings
from rlmega.step import judge_error_counts


def _judge_model(tmp_path, positions):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return str(tmp_path)


def test_engine_settings_come_from_the_judgers_own_fields(tmp_path):
    path = _judge_model(tmp_path, 32768)
    # before: RolloutWorker's defaults, a CPU engine of 512 tokens, whatever the config said
    # the model's 32768, capped
    assert engine_settings(JudgerConfig(kind="model", model_path=path)) == {
        "device": "cpu",
        "max_model_len": 4096,
        "kv_cache_space_gb": 1.0,
    }
    assert engine_settings(
        JudgerConfig(
            kind="model",
            model_path=path,
            device="cuda",
            max_model_len=8192,
            gpu_memory_utilization=0.2,
        )
    ) == {"device": "cuda", "max_model_len": 8192, "gpu_memory_utilization": 0.2}
    (tmp_path / "s").mkdir()
    small = _judge_model(tmp_path / "s", 512)
    assert engine_settings(JudgerConfig(kind="model", model_path=small))["max_model_len"] == 512


def test_a_cuda_judge_reserves_a_gpu_in_its_bundle():
    cpu, cuda = (
        JudgerConfig(name=d, kind="model", model_path="x", device=d, cpus_per_actor=0.5)
        for d in ("cpu", "cuda")
    )
    assert judger_bundles([cpu, cuda]) == [{"CPU": 0.5}, {"CPU": 0.5, "GPU": 1}]


@pytest.mark.parametrize(
    "bad,field,words",
    [
        (dict(max_model_len=4), ".max_model_len", "not in (max_tokens=4"),
        (dict(max_model_len=2**30), ".max_model_len", "not in (max_tokens=4"),
        (dict(max_model_len=1024), ".max_model_len", "max_position_embeddings=512"),
        (dict(gpu_memory_utilization=1.5), ".gpu_memory_utilization", "not in (0, 1]"),
        (dict(gpu_memory_utilization=float("nan")), ".gpu_memory_utilization", "not in (0, 1]"),
        (dict(kv_cache_space_gb=float("inf")), ".kv_cache_space_gb", "not in (0, 1024]"),
        (dict(device="tpu"), ".device", "not a device"),
    ],
)
def test_bad_judge_engine_settings_are_refused_with_the_field(tmp_path, bad, field, words):
    c = JudgerConfig(name="judge", kind="model", model_path=_judge_model(tmp_path, 512), **bad)
    problems = validate_judgers([c], "agent_loop.judgers", RewardConfig())
    assert len(problems) == 1 and problems[0].startswith(f"agent_loop.judgers[0]{field}: "), (
        problems
    )
    assert words in problems[0] and ". Fix: " in problems[0], problems


def test_load_gives_a_model_judge_the_rollout_device(tmp_path):
    from rlmega.config.load import load_config

    path = _judge_model(tmp_path, 512)
    cfg = load_config(None, [f"agent_loop.judgers=[{{name: j, kind: model, model_path: {path}}}]"])
    assert cfg.agent_loop.judgers[0].device == cfg.rollout.device == "cpu"


def test_judge_failures_are_counted_per_judger():
    def traj(error):
        return Trajectory(prompt_ids=[1], response_ids=[2], judge_error=error)

    too_long = (
        "judger 'judge' (model): the judge prompt has 700 tokens; with max_tokens=4 that exceeds "
        "the engine's max_model_len=512"
    )
    # dropped: not trained
    groups = [
        TrajectoryGroup(
            "t",
            0,
            "x",
            [
                traj(too_long),
                traj(None),
                traj(too_long + "; judger 'math' (native): ZeroDivisionError"),
            ],
        ),
        TrajectoryGroup("t", 1, "y", [traj(None)]),
        TrajectoryGroup("t", 2, "z", [traj(too_long)], error="generation failed"),
    ]
    assert judge_error_counts(groups) == {"judge": 2, "math": 1}
    assert judge_error_counts(groups[1:2]) == {}
