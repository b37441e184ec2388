"""Synthetic visual task: count the coloured shapes in an image drawn on the spot (data.synthetic_task=shapes).

Each problem is a 112 x 112 white image with 1..MAX_SHAPES filled circles or squares of random colours, sizes and
places (none overlapping), and the question "how many shapes?"; the label is the count as a digit, scored by
rlmega.rewards.arithmetic.score (the response opens with the digit). Rows come out as a vision-language model's
loader makes them (rlmega/data/images.py): a user message with an image placeholder part and a text part, and the
PNG's bytes in ``row["images"]``. Problem i of a seed is the same on every machine (numpy's PCG64 and PIL's
drawing of integer boxes); the eval set is drawn from another seed.
"""
from __future__ import annotations

import io

import numpy as np

SIZE = 112
MAX_SHAPES = 4
COLOURS = [(220, 30, 30), (30, 160, 30), (30, 60, 220), (230, 180, 0), (150, 40, 180)]
QUESTION = "how many shapes?"


def draw(rng: np.random.Generator, count: int) -> bytes:
    """A PNG of ``count`` non-overlapping shapes (radius 9..16) in random colours and places."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    placed: list[tuple[int, int, int]] = []
    while len(placed) < count:
        r = int(rng.integers(9, 17))
        x, y = (int(v) for v in rng.integers(r + 1, SIZE - r - 1, size=2))
        if any((x - a) ** 2 + (y - b) ** 2 < (r + c + 3) ** 2 for a, b, c in placed):
            continue
        placed.append((x, y, r))
        colour = COLOURS[int(rng.integers(len(COLOURS)))]
        box = (x - r, y - r, x + r, y + r)
        (pen.ellipse if rng.random() < 0.5 else pen.rectangle)(box, fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def shape_rows(n: int, seed: int, eval_set: bool = False) -> list[dict]:
    """n counting problems as prompt rows: {"prompt": [user message], "label": "3", "images": [png]}."""
    rng = np.random.default_rng([seed, 1 if eval_set else 0])
    rows = []
    for _ in range(n):
        count = int(rng.integers(1, MAX_SHAPES + 1))
        content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        rows.append({"prompt": [{"role": "user", "content": content}], "label": str(count),
                     "images": [draw(rng, count)]})
    return rows
