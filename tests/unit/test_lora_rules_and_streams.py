"""LoRA's pure parts: the streams that leave the learner (rlmega/learner/lora.py) and the checkpoint rule
(rlmega/config/lora_rules.py)."""

import pytest
import torch

from rlmega.learner import lora
from rlmega.config.lora_rules import checkpoint_record, resume_problems
from rlmega.config.schema import LoraConfig, RLConfig


def _named():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 5, generator=g), torch.randn(6, generator=g)
    a, bb = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    return [
        ("model.embed_tokens.weight", torch.ones(3, 5)),
        ("model.layers.0.q_proj.base_layer.weight", w),
        ("model.layers.0.q_proj.base_layer.bias", b),
        ("model.layers.0.q_proj.lora_A.default.weight", a),
        ("model.layers.0.q_proj.lora_B.default.weight", bb),
        ("model.layers.0.k_proj.weight", torch.zeros(2, 5)),
    ], (w, b, a, bb)


def test_merged_weights_are_the_plain_models_with_w_plus_scale_b_a():
    named, (w, b, a, bb) = _named()
    out = dict(lora.merged_weights(named, scale=4.0))
    assert list(out) == [
        "model.embed_tokens.weight",
        "model.layers.0.q_proj.bias",
        "model.layers.0.q_proj.weight",
        "model.layers.0.k_proj.weight",
    ]
    assert torch.equal(out["model.layers.0.q_proj.weight"], w + 4.0 * bb @ a)
    assert torch.equal(out["model.layers.0.q_proj.bias"], b)
    with pytest.raises(RuntimeError, match="without their adapters"):
        list(lora.merged_weights(named[:3], 1.0))


def test_adapter_weights_carry_peft_saved_names():
    named, _ = _named()
    assert [n for n, _ in lora.adapter_weights(named)] == [
        "base_model.model.model.layers.0.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.q_proj.lora_B.weight",
    ]


def _ckpt(folder, saved):
    step = folder / "step_00000002"
    step.mkdir(parents=True)
    torch.save({"meta": {"backend": "fsdp", "lora": saved}}, step / "common.pt")
    return step


def test_resume_takes_the_same_adapters_or_a_full_checkpoint_and_refuses_lora_into_full(tmp_path):
    cfg = RLConfig()
    cfg.actor.backend = "fsdp"
    cfg.actor.lora = LoraConfig(rank=8)
    record = checkpoint_record(cfg.actor.lora)
    assert resume_problems(cfg, _ckpt(tmp_path / "same", record)) == []
    assert resume_problems(cfg, _ckpt(tmp_path / "full", None)) == []  # becomes the base
    (line,) = resume_problems(cfg, _ckpt(tmp_path / "rank16", {**record, "rank": 16}))
    assert line.startswith("trainer.resume: checkpoint") and "shapes differ" in line
    cfg.actor.lora = LoraConfig()  # a full-parameter run
    (line,) = resume_problems(cfg, _ckpt(tmp_path / "lora", record))
    assert (
        "holds a LoRA run's adapters" in line and "Fix: resume it with the same actor.lora" in line
    )


def test_the_slot_ranks_are_the_installed_vllms():
    import typing

    from vllm.config.lora import MaxLoRARanks

    from rlmega.config.lora_rules import LORA_SLOT_RANKS
    from rlmega.rollout.engine_lifecycle import lora_slot_rank

    assert LORA_SLOT_RANKS == typing.get_args(MaxLoRARanks)
    assert [lora_slot_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
