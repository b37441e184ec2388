"""The zoom tool's image work: a box of one of the prompt's images, cut out and enlarged. Pure functions.

    box = parse_box("25 25 75 75")          # Box(image=0, left=25, top=25, right=75, bottom=75), percent
    png = zoom(images[box.image], box)      # the box's pixels enlarged to at most the image's own size

A call's arguments are what a model wrote (hostile input): four whole numbers, percent of the image's
width and height (left top right bottom), optionally after an image number (1 = the prompt's first
image). Percent rather than pixels: the model sees the image as the processor resized it, so pixel
coordinates of the original would mean nothing to it. The result is never larger than the image it
came from (the image already passed data.max_image_pixels at load), so a zoom cannot grow a request.
Anything wrong raises ValueError with a message for the model (rlmega.agents.tools turns it into
"error: ...").
"""

from __future__ import annotations

import dataclasses
import io

MAX_ARGS_CHARS = 64


@dataclasses.dataclass(frozen=True)
class Box:
    image: int
    """Index into the prompt's images (0 = the first)."""
    left: int
    top: int
    right: int
    bottom: int
    """Percent of the image's width (left, right) and height (top, bottom); left < right, top < bottom."""


def parse_box(args: str) -> Box:
    """``"[IMAGE] LEFT TOP RIGHT BOTTOM"`` (whole numbers; commas or spaces between) -> Box."""
    if len(args) > MAX_ARGS_CHARS:
        raise ValueError(f"box too long (at most {MAX_ARGS_CHARS} characters)")
    parts = args.replace(",", " ").split()
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts):
        raise ValueError("give left top right bottom as whole percents, e.g. 25 25 75 75")
    numbers = [int(p) for p in parts]
    image = numbers.pop(0) - 1 if len(numbers) == 5 else 0
    left, top, right, bottom = numbers
    if image < 0:
        raise ValueError("images are numbered from 1")
    if max(numbers) > 100 or left >= right or top >= bottom:
        raise ValueError("need 0 <= left < right <= 100 and 0 <= top < bottom <= 100")
    return Box(image, left, top, right, bottom)


def zoom(image: bytes, box: Box) -> bytes:
    """The ``box`` of an encoded ``image``, enlarged by the largest factor that keeps it within the image's own
    width and height, as PNG bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(image)) as img:
        img = img.convert("RGB")
    w, h = img.size
    x0, x1 = _span(box.left, box.right, w)
    y0, y1 = _span(box.top, box.bottom, h)
    crop = img.crop((x0, y0, x1, y1))
    # >= 1: the box grows until one side meets the image's
    scale = min(w / (x1 - x0), h / (y1 - y0))
    size = (max(1, min(w, round((x1 - x0) * scale))), max(1, min(h, round((y1 - y0) * scale))))
    out = io.BytesIO()
    crop.resize(size, Image.Resampling.BICUBIC).save(out, format="PNG")
    return out.getvalue()


def _span(lo: int, hi: int, n: int) -> tuple[int, int]:
    """Pixel bounds [a, b) of percents [lo, hi) of n pixels, at least one pixel wide."""
    a = min(n - 1, lo * n // 100)
    return a, max(a + 1, min(n, -(-hi * n // 100)))
