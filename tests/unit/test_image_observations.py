"""Image observations (a tool's image answer in a multi-turn loop): their tokens for the engine and the trainer
(rlmega/agents/image_observations.py), and which image placeholders of a packed row the trainer feeds image
features to (rlmega/fsdp/vision_inputs.py). The engine and trainer agreeing on real trajectories with them:
tests/e2e/test_vlm_engine.py."""

import io

import pytest
import torch

from rlmega.agents.image_observations import Observations, image_placeholder_text
from rlmega.agents.tool_protocol import RESULT_CLOSE, RESULT_OPEN
from rlmega.data.images import load_processor, processor_vision
from rlmega.demo.tiny_vlm import make_tiny_vlm


def _png(size) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (0, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return load_processor(
        str(make_tiny_vlm(tmp_path_factory.mktemp("m") / "idefics3", arch="idefics3"))
    )


def test_the_placeholder_is_what_the_chat_template_writes_for_an_image(idefics3, tmp_path):
    from transformers import AutoTokenizer

    assert image_placeholder_text(idefics3) == "<image>"
    # Qwen2-VL's processor cannot be built here (rlmega/demo/tiny_vlm.py); its chat template is the tokenizer's
    qwen = AutoTokenizer.from_pretrained(make_tiny_vlm(tmp_path / "qwen2_vl", arch="qwen2_vl"))
    assert image_placeholder_text(qwen) == "<|vision_start|><|image_pad|><|vision_end|>"


def test_the_engine_gets_one_placeholder_and_the_trainer_the_expansion(idefics3):
    tok = idefics3.tokenizer
    image = tok.convert_tokens_to_ids("<image>")
    obs = Observations(idefics3)
    engine, scored, (a, b) = obs.tokens(_png((64, 48)))
    marker = tok(RESULT_OPEN, add_special_tokens=False)["input_ids"]
    assert engine == marker + [image] + tok(RESULT_CLOSE, add_special_tokens=False)["input_ids"]
    assert scored[:a] == marker and scored[b:] == engine[len(marker) + 1 :]
    assert scored[a:b].count(image) == 16  # one 112x112 tile, as a prompt's image
    # the trajectory's inputs: the prompt's image then the observation's, and where the observation sits
    prompt = idefics3.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], tokenize=False
    )
    prompt_png, seen = _png((100, 100)), _png((64, 48))
    _, prompt_ids = processor_vision(idefics3, prompt, [prompt_png])
    vision = obs.trajectory_vision(
        prompt, [prompt_png], [seen], [(5 + a, 5 + b)], scored=prompt_ids + scored[a:b]
    )
    assert vision["pixel_values"].shape[:2] == (1, 2) and vision["observation_spans"].tolist() == [
        [5 + a, 5 + b]
    ]
    with pytest.raises(ValueError, match="expands a trajectory's images otherwise"):
        obs.trajectory_vision(prompt, [prompt_png], [seen], [(0, 1)], scored=prompt_ids)


def test_no_image_after_a_placeholder_the_model_sampled(idefics3):
    obs, image = Observations(idefics3), idefics3.tokenizer.convert_tokens_to_ids("<image>")
    # a tool put it there
    assert not obs.follows_a_sampled_placeholder([1, 2, image, 3], [1.0, 1.0, 0.0, 1.0])
    assert obs.follows_a_sampled_placeholder([1, 2, image, 3], [1.0, 1.0, 1.0, 1.0])


def test_a_text_only_model_has_no_image_observations():
    with pytest.raises(ValueError, match="an image observation needs a vision-language model"):
        Observations(None)


def test_observation_placeholders_get_features_and_sampled_ones_stay_text():
    from types import SimpleNamespace

    from rlmega.fsdp.vision_inputs import sampled_placeholders

    config = SimpleNamespace(image_token_id=9)
    # two sequences in a row: [prompt 9 9 1 | response 2 9 3 9 9 4] and [prompt 9 1 | response 9 2]
    row = torch.tensor([[9, 9, 1, 2, 9, 3, 9, 9, 4, 9, 1, 9, 2]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]])
    # response's 9 9
    spans = {"pixel_values": torch.zeros(1), "observation_spans": torch.tensor([[3, 5]])}
    mask = sampled_placeholders(row, pos, config, prompt_ends=[3, 11], per_seq=[spans, None])
    assert mask.tolist() == [False] * 4 + [True] + [False] * 6 + [True, False]
    no_spans = sampled_placeholders(row, pos, config, prompt_ends=[3, 11], per_seq=[None, None])
    assert no_spans.tolist() == [False] * 4 + [True, False, True, True] + [False] * 3 + [
        True,
        False,
    ]


def test_engines_take_the_prompt_images_and_a_tool_loops_observations():
    import dataclasses

    from rlmega.config.schema import AgentLoopConfig, RLConfig, RolloutConfig
    from rlmega.launch.engines import images_per_request

    cfg = RLConfig(rollout=RolloutConfig(max_images_per_prompt=2))
    assert images_per_request(cfg) == 2
    zoom = AgentLoopConfig(kind="tool", tools=["calculator", "zoom"], max_turns=4)
    # one a turn after the first
    assert images_per_request(dataclasses.replace(cfg, agent_loop=zoom)) == 2 + 3
    assert (
        images_per_request(
            dataclasses.replace(cfg, agent_loop=dataclasses.replace(zoom, tools=["python"]))
        )
        == 2
    )
