"""Synthetic visual task: name the colour of the shapes in an image drawn on the spot (data.synthetic_task=shapes).

Each problem is a 112 x 112 white image with 1..MAX_SHAPES filled circles or squares of one colour (of COLOURS),
random sizes and places (none overlapping), and a multiple-choice question naming the colours by their initials;
the label is the colour's initial ("b" for blue), scored by rlmega.rewards.shapes.score (the response opens with
it). One letter, because the tiny models' tokenizer is one token per character: with whole names the tiny
language model's spelling ("yllow") hid what its vision tower saw. Rows come out as a vision-language
model's loader makes them (rlmega/data/images.py): a user message with an image placeholder part and a text part,
and the PNG's bytes in ``row["images"]``. Problem i of a seed is the same on every machine (numpy's PCG64 and
PIL's drawing of integer boxes); the eval set is drawn from another seed.
"""

from __future__ import annotations

import io

import numpy as np

SIZE = 112
MAX_SHAPES = 3
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 30),
    "blue": (30, 60, 220),
    "yellow": (230, 180, 0),
    "purple": (150, 40, 180),
}
QUESTION = "colour? " + " ".join(name[0] for name in COLOURS)  # "colour? r g b y p"


def draw(rng: np.random.Generator, count: int, colour: tuple[int, int, int]) -> bytes:
    """A PNG of ``count`` non-overlapping shapes (radius 9..16) of ``colour`` in random places."""
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
        box = (x - r, y - r, x + r, y + r)
        (pen.ellipse if rng.random() < 0.5 else pen.rectangle)(box, fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def shape_rows(n: int, seed: int, eval_set: bool = False) -> list[dict]:
    """n problems as prompt rows: {"prompt": [user message], "label": "b", "images": [png]}."""
    rng = np.random.default_rng([seed, 1 if eval_set else 0])
    names = list(COLOURS)
    rows = []
    for _ in range(n):
        name = names[int(rng.integers(len(names)))]
        content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": content}],
                "label": name[0],
                "images": [draw(rng, int(rng.integers(1, MAX_SHAPES + 1)), COLOURS[name])],
            }
        )
    return rows
