"""Image observations in a multi-turn loop: a tool's image answer as tokens for the engine and for the trainer.

A vision-language prompt holds its images twice over (rlmega/agents/loop.py): the engine gets one placeholder
per image and expands it itself; the trainer scores the processor's expansion. An image a tool answers with
(rlmega/agents/tools.py ImageResult, e.g. the zoom tool) is the same: the engine's next turn gets
``<result>`` + one placeholder + ``</result>`` and the image; the trajectory keeps the processor's expansion
(masked out of the loss like any tool result). The loop checks the engine's expansion of the whole context
against the trajectory on the next turn.

    obs = Observations(processor)
    engine_ids, scored_ids, (start, end) = obs.tokens(png)
    vision = obs.trajectory_vision(prompt_text, prompt_images, [png, ...], spans)

The trainer must feed image features to an observation's placeholders and to no sampled one: the
trajectory's vision inputs carry each observation's span in the response (``observation_spans``, (k, 2)
[start, end) offsets from the response's first token; rlmega/fsdp/vision_inputs.py reads them).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from rlmega.agents.tool_protocol import RESULT_CLOSE, RESULT_OPEN
from rlmega.data.images import processor_vision
from rlmega.data.rollout_batch import OBSERVATION_SPANS


def image_placeholder_text(processor) -> str:
    """What the model's chat template writes for one image (Idefics3: "<image>"; Qwen2-VL:
    "<|vision_start|><|image_pad|><|vision_end|>"): a message with an image part less one without."""

    def render(part: dict) -> str:
        return processor.apply_chat_template([{"role": "user", "content": [part]}], tokenize=False)

    with_image, without = render({"type": "image"}), render({"type": "text", "text": ""})
    head = len(os.path.commonprefix([with_image, without]))
    tail = len(os.path.commonprefix([with_image[head:][::-1], without[head:][::-1]]))
    text = with_image[head : len(with_image) - tail]
    token = getattr(processor, "image_token", None)
    if not text or (token and token not in text):
        raise ValueError(
            f"cannot tell how the chat template writes an image (got {text!r}); the processor's image "
            f"token is {token!r}"
        )
    return text


class Observations:
    """A model's processor, for the tokens and trainer inputs of image observations."""

    def __init__(self, processor):
        if processor is None:
            raise ValueError(
                "an image observation needs a vision-language model (model.path has no processor "
                "with an image processor)"
            )
        self.processor = processor
        self.placeholder = image_placeholder_text(processor)
        tok = processor.tokenizer
        # the markers as text even where a tokenizer has them as special tokens (tool output is never one)
        self.open = tok(RESULT_OPEN, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
        self.close = tok(RESULT_CLOSE, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
        self.engine_placeholder = tok(self.placeholder, add_special_tokens=False)["input_ids"]

    def follows_a_sampled_placeholder(
        self, response_ids: Sequence[int], response_mask: Sequence[float]
    ) -> bool:
        """Whether the model sampled an image placeholder token earlier in the response: vLLM expands a request's
        first N placeholders for its N images, so an image after such a token would have its features put in the
        sampled token's place (the loop answers with an error instead)."""
        ids = set(self.engine_placeholder) & set(self.processor.tokenizer.all_special_ids)
        return any(i in ids and m > 0 for i, m in zip(response_ids, response_mask))

    def tokens(self, png: bytes) -> tuple[list[int], list[int], tuple[int, int]]:
        """(the engine's ids, the trainer's ids, the image's expansion's [start, end) in the trainer's ids) of
        ``<result>IMAGE</result>``."""
        _, expanded = processor_vision(self.processor, self.placeholder, [png])
        return (
            self.open + self.engine_placeholder + self.close,
            self.open + expanded + self.close,
            (len(self.open), len(self.open) + len(expanded)),
        )

    def trajectory_vision(
        self,
        prompt_text: str,
        prompt_images: Sequence[bytes],
        observed: Sequence[bytes],
        spans: Sequence[tuple[int, int]],
        scored: list[int],
    ) -> dict:
        """The processor's image inputs of a trajectory: the prompt's images, then each observation's, in order,
        with ``observation_spans``. ``scored``: the trajectory's prompt ids followed by each observation's
        expanded ids (what the processor must expand the images into, checked)."""
        vision, ids = processor_vision(
            self.processor,
            prompt_text + self.placeholder * len(observed),
            list(prompt_images) + list(observed),
        )
        if ids != scored:
            raise ValueError(
                "the processor expands a trajectory's images otherwise than one image at a time"
            )
        vision[OBSERVATION_SPANS] = torch.tensor(list(spans), dtype=torch.int64).reshape(-1, 2)
        return vision
