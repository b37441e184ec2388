"""Images in prompt rows: content parts, where their bytes come from, and the checks made at load.

A chat prompt's message may hold a list of content parts instead of a string, as OpenAI's and Hugging
Face's chat formats write them:

    {"role": "user", "content": [{"type": "image", "image": "shapes/0001.png"},
                                 {"type": "text", "text": "How many circles?"}]}

An image part's source (``image``, or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``) is
- a file path (relative to the data file's folder, or absolute),
- a ``data:image/...;base64,...`` URI,
- an http(s) URL (fetched once, at load),
- bytes (a Parquet column of binary; or Hugging Face datasets' ``{"bytes": ..., "path": ...}``).
Each is read and decoded once at load (``load_image``): a missing file, an unreadable or corrupt image, or one
of more than ``max_pixels`` pixels is a bad row, named by file and row. The row keeps the encoded bytes
(``row["images"]``, in order) and its parts become ``{"type": "image"}`` placeholders for the chat template.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.request
from typing import Any

IMAGE_TYPES = ("image", "image_url")
URL_TIMEOUT_S = 30


class BadImage(ValueError):
    """An image part that cannot be used; the message says what and the fix."""


def _source(part: dict) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    src = part.get("image")
    return src.get("bytes") or src.get("path") if isinstance(src, dict) else src


def read_source(source: Any, base_dir: str) -> bytes:
    """The encoded bytes of an image part's source (see the module docstring)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise BadImage(f"an image part's source is {type(source).__name__}, not a path, URL, data URI or bytes. "
                       'Fix: write {"type": "image", "image": "PATH_OR_URL"}')
    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if not head.endswith(";base64"):
            raise BadImage(f"data URI {source[:40]!r}... is not base64. Fix: write data:image/png;base64,<data>")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadImage(f"data URI {source[:40]!r}... is not valid base64 ({e}). Fix: re-encode the image") from e
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=URL_TIMEOUT_S) as r:  # noqa: S310 (http(s) only, checked)
                return r.read()
        except OSError as e:
            raise BadImage(f"image URL {source} could not be fetched ({e}). Fix: check the URL, or store the "
                           "image next to the data file and give its path") from e
    path = source if os.path.isabs(source) else os.path.join(base_dir, source)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BadImage(f"image file {path} cannot be read ({e.strerror}). Fix: give a path relative to the data "
                       "file's folder, or an absolute one") from e


def check_image(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an encoded image, decoded whole; BadImage when it is corrupt or over ``max_pixels``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:  # before decoding: a huge image is refused without being held
                raise BadImage(f"image of {width}x{height} = {width * height} pixels is over "
                               f"data.max_image_pixels={max_pixels}. Fix: resize it, or raise data.max_image_pixels")
            img.load()
    except BadImage:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, decompression bombs
        raise BadImage(f"image is not readable ({type(e).__name__}: {e}). Fix: re-save it as PNG or JPEG") from e
    return width, height


def load_image(source: Any, base_dir: str, max_pixels: int) -> bytes:
    """An image part's source -> its encoded bytes, checked (``check_image``)."""
    data = read_source(source, base_dir)
    check_image(data, max_pixels)
    return data


def split_images(messages: list, base_dir: str, max_pixels: int) -> tuple[list, list[bytes]]:
    """(messages with each image part as ``{"type": "image"}``, the images' bytes in order). A message whose
    content is a string is kept as it is. BadImage / ValueError name the message and part."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, str):
            out.append(dict(m))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"message {i}, part {j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}: a text part needs a string 'text'. Fix: "
                                     '{"type": "text", "text": "..."}')
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_TYPES:
                try:
                    images.append(load_image(_source(part), base_dir, max_pixels))
                except BadImage as e:
                    raise BadImage(f"{where}: {e}") from e
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where} is {str(part)[:60]}: a content part is "
                                 '{"type": "text", "text": ...} or {"type": "image", "image": PATH_OR_URL}')
        out.append({**m, "content": parts})
    return out, images


def decode_images(images: list[bytes]) -> list:
    """Encoded image files -> PIL images, as processors and vLLM's multi-modal requests take them (each
    converts to RGB itself)."""
    from PIL import Image

    out = []
    for data in images:
        img = Image.open(io.BytesIO(data))
        img.load()  # read now, not lazily later
        out.append(img)
    return out


def is_vlm_folder(path: str) -> bool:
    """Whether the model folder's config.json describes a vision-language model (it has a ``vision_config``)."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("vision_config") is not None
    except (OSError, ValueError):
        return False


def load_processor(path: str):
    """A vision-language model folder's processor (transformers' AutoProcessor: chat template, tokenizer and
    image processor), or None for a text-only model."""
    if not is_vlm_folder(path):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


# What a processor returns besides the images' own tensors (the tokens are the prompt's)
_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def processor_vision(processor, text: str, images) -> tuple[dict, list[int]]:
    """(the processor's image tensors for the trainer: pixel_values and the family's layout, the expanded token ids)
    of a rendered prompt ``text`` with its ``images`` (encoded files)."""
    import torch

    enc = processor(text=[text], images=[decode_images(list(images))], add_special_tokens=False, return_tensors="pt")
    vision = {k: v for k, v in enc.items() if k not in _TOKEN_KEYS and isinstance(v, torch.Tensor)}
    return vision, [int(t) for t in enc["input_ids"][0]]
