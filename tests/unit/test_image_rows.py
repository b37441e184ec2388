"""Prompt rows with images (rlmega/data/images.py, rlmega/data/prompts.py): every source form, the checks made at
load, and the tokens a vision-language model's processor gives them (one placeholder per image for the engine,
expanded for the trainer)."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from rlmega.data.images import BadImage, split_images
from rlmega.data.prompts import BadRowError, PromptDataset, load_rows
from rlmega.data.shapes import COLOURS, draw, shape_rows


@pytest.fixture(scope="module")
def png():
    return draw(np.random.default_rng(0), 2, COLOURS["blue"])


def _message(*sources, kind="image"):
    parts = [{"type": kind, kind: s} if kind == "image" else {"type": "image_url", "image_url": {"url": s}}
             for s in sources]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what colour?"}]}]


def test_every_source_form_gives_the_same_bytes(tmp_path, png):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    for messages in (_message("sub/a.png"), _message(str(tmp_path / "sub" / "a.png")), _message(uri),
                     _message(png), _message({"bytes": png, "path": None}), _message(uri, kind="image_url")):
        out, images = split_images(messages, str(tmp_path), max_pixels=10**6)
        assert images == [png]
        assert out[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what colour?"}]


@pytest.mark.parametrize("source, message", [
    ("nope.png", "message 0, part 0: image file .*nope.png cannot be read"),
    ("data:image/png;base64,@@@", "is not valid base64"),
    ("data:image/png,xyz", "is not base64"),
    (b"\x89PNG\r\n\x1a\n not an image", "image is not readable"),
    (12, "source is int, not a path, URL, data URI or bytes"),
])
def test_a_bad_image_is_named(tmp_path, source, message):
    with pytest.raises(BadImage, match=message):
        split_images(_message(source), str(tmp_path), max_pixels=10**6)


def test_an_oversize_image_is_refused_before_decoding(tmp_path, png):
    with pytest.raises(BadImage, match=r"112x112 = 12544 pixels is over data.max_image_pixels=10000"):
        split_images(_message(png), str(tmp_path), max_pixels=10_000)


def test_jsonl_and_parquet_rows_carry_their_images(tmp_path, png):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": _message("a.png"), "label": "2"}) + "\n"
                                         + json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    rows, _ = load_rows(str(tmp_path / "rows.jsonl"))
    assert rows[0]["images"] == [png] and "images" not in rows[1]
    pq.write_table(pa.Table.from_pylist([{"prompt": _message(png), "label": "2"}]), tmp_path / "rows.parquet")
    rows, _ = load_rows(str(tmp_path / "rows.parquet"))
    assert rows[0]["images"] == [png]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": _message("a.png"), "label": "2"}) + "\n"
                                        + json.dumps({"prompt": _message("gone.png"), "label": "2"}) + "\n")
    with pytest.raises(BadRowError, match=r"bad.jsonl, row 2: prompt 'prompt', message 0, part 0: image file"):
        load_rows(str(tmp_path / "bad.jsonl"))
    rows, skipped = load_rows(str(tmp_path / "bad.jsonl"), on_bad_row="skip")
    assert len(rows) == 1 and skipped.count == 1


def test_text_parts_without_images_become_a_plain_string(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": messages, "label": "2"}) + "\n")
    rows, _ = load_rows(str(tmp_path / "rows.jsonl"))
    assert rows[0]["prompt"] == [{"role": "user", "content": "1+1="}] and "images" not in rows[0]


def test_the_processor_expands_what_the_engine_gets_one_placeholder_of(tmp_path):
    from transformers import AutoProcessor

    from rlmega.tiny_vlm import make_tiny_vlm

    path = make_tiny_vlm(tmp_path / "vlm", arch="idefics3")
    proc = AutoProcessor.from_pretrained(path)
    rows = shape_rows(3, seed=0)
    data = PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64, processor=proc, max_images=1)
    image_token = proc.tokenizer.convert_tokens_to_ids("<image>")
    for p, row in zip(data, rows):
        assert p.images == tuple(row["images"]) and p.engine_ids.count(image_token) == 1
        assert p.token_ids.count(image_token) == 16  # one 112x112 tile, 8x8 patches shuffled by 2: 16 tokens
        assert p.request_ids() == p.engine_ids
    with pytest.raises(BadRowError, match="row 1: the prompt has 1 image.*text-only model"):
        PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64)
    with pytest.raises(BadRowError, match="over rollout.max_images_per_prompt=0"):
        PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64, processor=proc, max_images=0)


def test_the_colour_reward_wants_the_word():
    from rlmega.rewards.shapes import score

    responses = ("blue", "blue</s>", "blue.", "bluey", "blu", " blue", "")
    assert [score(r, "blue") for r in responses] == [1, 1, 1, 0, 0, 0, 0]


def test_shape_problems_are_reproducible_and_the_eval_set_differs():
    a, b, ev = shape_rows(20, seed=3), shape_rows(20, seed=3), shape_rows(20, seed=3, eval_set=True)
    assert [r["images"] for r in a] == [r["images"] for r in b]
    assert {r["label"] for r in a} <= {name[0] for name in COLOURS}
    assert [r["images"] for r in a] != [r["images"] for r in ev]
