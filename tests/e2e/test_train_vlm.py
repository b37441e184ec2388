"""`rlmega train configs/vlm_cpu.yaml` end to end on a tiny Idefics3 (issue 43), as a user runs it, shortened:
images of coloured shapes drawn on the spot, a warm start, 4 RL steps with the asynchronous producer's deterministic
schedule (its buffer of image batches is in the checkpoints), checkpoints every 2 steps.

- ``straight``: 4 uninterrupted steps, the reference;
- ``killed``: the same run killed with SIGKILL once its step-2 checkpoint exists, then resumed to step 4: its
  steps 3-4 equal the reference's exactly;
- the HF export (hf_final) loads in transformers with its processor and holds exactly the trainer's weights.
"""

import sys

import pytest
from conftest import ROOT, checkpointed, kill_9, read_metrics, run_ok, same_numbers

from rlmega.demo.tiny_vlm import make_tiny_vlm

ASYNC = (
    "produce.strategy=async",
    "produce.max_staleness=1",
    "produce.deterministic=true",
    "algorithm.rollout_correction=tis",
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny_vlm", arch="idefics3", seed=0))


def _cmd(model, run, steps, *extra, schedule=ASYNC):
    return [
        sys.executable,
        "-m",
        "rlmega.train",
        str(ROOT / "configs/vlm_cpu.yaml"),
        f"model.path={model}",
        f"trainer.run_dir={run}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=2",
        "trainer.warmup_sft_steps=8",
        "optimizer.lr_warmup_steps=8",
        "trainer.eval_every=0",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "trainer.global_batch_size=16",
        "data.synthetic_size=64",
        # a reward with spread in every group (a barely warm-started model gets the colour wrong everywhere):
        # every step updates the weights, so the resume has moved weights and Adam state to restore
        "reward.fn=rlmega.testing.rewards.digit_fraction",
        *schedule,
        *extra,
    ]


@pytest.fixture(scope="module")
def straight(vlm, tmp_path_factory):
    run = tmp_path_factory.mktemp("vlm_straight")
    run_ok(_cmd(vlm, run, 4))
    return run


def test_kill_9_and_resume_equals_the_uninterrupted_run(vlm, straight, tmp_path):
    run = tmp_path / "killed"
    kill_9(_cmd(vlm, run, 4), checkpointed(run), timeout=400, poll_s=0.05)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    run_ok(_cmd(vlm, run, 4, "--resume"))
    got, want = read_metrics(run), read_metrics(straight)
    assert [m["step"] for m in want] == [1, 2, 3, 4]
    assert all(m["grad_norm"] > 0 for m in want), want  # real updates at every step
    assert want[0]["logprob_diff_max"] <= 5e-6 and want[0]["parity_samples"] > 0, want[0]
    for g, w in zip(got[2:], want[2:]):
        assert same_numbers(g, w) == {}, (g["step"], same_numbers(g, w))


def test_the_export_loads_in_transformers_and_holds_the_trainers_weights(straight):
    """hf_final loads with AutoModelForImageTextToText and its processor, and holds exactly the weights of the
    trainer's step-4 checkpoint (whose forward is transformers' own: tests/unit/test_vlm_packing.py)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlmega.data.images import processor_vision
    from rlmega.data.shapes import shape_rows

    export = straight / "hf_final"
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(export)
    row = shape_rows(1, seed=5)[0]
    text = proc.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    vision, ids = processor_vision(proc, text, row["images"])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids]), **vision).logits).all()
    exported = load_file(export / "model.safetensors")
    saved = {k: torch.empty_like(v) for k, v in exported.items()}
    dcp.load({"model": saved}, checkpoint_id=str(straight / "checkpoints" / "step_00000004"))
    assert sorted(saved) == sorted(exported) and all(
        torch.equal(saved[k], exported[k]) for k in saved
    )
