"""RolloutBatch: shape contract, select/split/concat, atomic safetensors save/load."""

import dataclasses
import os

import pytest
import torch

from rlmega.data.rollout_batch import (
    OPTIONAL_FIELDS,
    RESPONSE_FIELDS,
    SAMPLE_FIELDS,
    TOKEN_FIELDS,
    VISION_FIELDS,
    RolloutBatch,
)

PROMPT_LENS = [3, 2, 4, 1, 2]
RESPONSE_LENS = [2, 5, 0, 3, 1]


def make_batch(full: bool = True, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPT_LENS)

    def per_token():
        return [torch.randn(r, generator=g) for r in RESPONSE_LENS]

    fields = dict(
        tokens=[
            torch.randint(0, 100, (p + r,), generator=g) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)
        ],
        prompt_lens=torch.tensor(PROMPT_LENS),
        response_mask=[(torch.rand(r, generator=g) > 0.3).float() for r in RESPONSE_LENS],
        group_ids=torch.tensor([0, 0, 1, 1, 2]),
        sample_ids=torch.tensor([10, 11, 12, 13, 14]),
    )
    if full:
        fields.update(
            rollout_logprobs=per_token(),
            rewards=torch.randn(n, generator=g),
            advantages=per_token(),
            old_logprobs=per_token(),
            ref_logprobs=per_token(),
            returns=per_token(),
            old_values=per_token(),
            # (L_i, 2 MoE layers, top-2) expert ids, -1 on the last token (never routed by the engine).
            routed_experts=[
                torch.cat(
                    [torch.randint(0, 8, (p + r - 1, 2, 2), generator=g), torch.full((1, 2, 2), -1)]
                ).to(torch.int16)
                for p, r in zip(PROMPT_LENS, RESPONSE_LENS)
            ],
        )
        # a VLM's images: samples of one prompt share their processor outputs; sample 2 has no image
        shared = {
            "pixel_values": torch.randn(8, 12, generator=g),
            "image_grid_thw": torch.tensor([[1, 2, 4]]),
        }
        own = [
            {
                "pixel_values": torch.randn(1, k, 3, 4, 4, generator=g),
                "pixel_attention_mask": torch.ones(1, k, 4, 4, dtype=torch.bool),
            }
            for k in (1, 2)
        ]
        fields["vision"] = [shared, shared, None, *own]
    return RolloutBatch(**fields)


def assert_batches_equal(a: RolloutBatch, b: RolloutBatch):
    assert len(a) == len(b)
    for x, y in zip(a.tokens, b.tokens):
        assert torch.equal(x, y)
    for name in SAMPLE_FIELDS + RESPONSE_FIELDS + TOKEN_FIELDS + VISION_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        if name in VISION_FIELDS:
            assert [None if u is None else sorted(u) for u in x] == [
                None if v is None else sorted(v) for v in y
            ]
            for u, v in zip(x, y):
                for k in u or {}:
                    assert u[k].dtype == v[k].dtype and torch.equal(u[k], v[k]), (name, k)
            continue
        if name in SAMPLE_FIELDS:
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert len(x) == len(y), name
            for u, v in zip(x, y):
                assert u.dtype == v.dtype and torch.equal(u, v), name


def test_sizes():
    b = make_batch()
    assert len(b) == 5
    assert b.lengths() == [5, 7, 4, 4, 3]
    assert b.response_lens() == RESPONSE_LENS
    assert b.num_tokens() == 23
    assert b.num_response_tokens() == 11
    assert [t.tolist() for t in b.response_tokens()] == [
        t[p:].tolist() for t, p in zip(b.tokens, PROMPT_LENS)
    ]


@pytest.mark.parametrize("full", [True, False])
def test_select_any_order_keeps_fields(full):
    b = make_batch(full)
    s = b.select([3, 0, 4])
    assert s.sample_ids.tolist() == [13, 10, 14]
    assert s.response_lens() == [3, 2, 1]
    assert_batches_equal(s, RolloutBatch.concat([b.select([3]), b.select([0]), b.select([4])]))
    for name in OPTIONAL_FIELDS:
        assert (getattr(s, name) is None) == (not full)
    assert_batches_equal(b.select(torch.arange(5)), b)
    assert len(b.select([])) == 0
    with pytest.raises(IndexError, match="index 5"):
        b.select([5])


@pytest.mark.parametrize(
    "n_parts,sizes", [(1, [5]), (2, [3, 2]), (3, [2, 2, 1]), (5, [1] * 5), (7, [1] * 5 + [0] * 2)]
)
def test_split_concat_round_trip(n_parts, sizes):
    b = make_batch()
    parts = b.split(n_parts)
    assert [len(p) for p in parts] == sizes
    assert_batches_equal(RolloutBatch.concat(parts), b)


def test_split_and_concat_errors():
    b = make_batch()
    with pytest.raises(ValueError, match="n_parts"):
        b.split(0)
    with pytest.raises(ValueError, match="at least one"):
        RolloutBatch.concat([])
    with pytest.raises(ValueError, match="rewards is set in some batches but not in batch 1"):
        RolloutBatch.concat([b, dataclasses.replace(make_batch(False), sample_ids=torch.arange(5))])


@pytest.mark.parametrize("full", [True, False])
def test_save_load_round_trip(tmp_path, full):
    b = make_batch(full)
    path = tmp_path / "batch.safetensors"
    b.save(path)
    assert os.listdir(tmp_path) == ["batch.safetensors"]  # no temp file left behind
    assert_batches_equal(RolloutBatch.load(path), b)
    b.select([]).save(path)  # overwrite, empty batch
    assert len(RolloutBatch.load(path)) == 0


def test_save_is_atomic(tmp_path, monkeypatch):
    """A crash mid-write keeps the old file whole and leaves no partial file."""
    path = tmp_path / "batch.safetensors"
    make_batch().save(path)

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        make_batch(seed=1).save(path)
    assert os.listdir(tmp_path) == ["batch.safetensors"]
    assert_batches_equal(RolloutBatch.load(path), make_batch())


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not an rlmega.RolloutBatch"):
        RolloutBatch.load(path)


def test_replace_revalidates():
    b = make_batch(False)
    assert dataclasses.replace(b, rewards=torch.ones(5)).rewards.tolist() == [1.0] * 5
    with pytest.raises(ValueError, match=r"rewards must be a tensor of shape \(5,\)"):
        dataclasses.replace(b, rewards=torch.ones(4))


def _with(**changes):
    b = make_batch()
    fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    fields.update(changes)
    return fields


def _replace_item(name, i, value):
    items = list(getattr(make_batch(), name))
    items[i] = value
    return _with(**{name: items})


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            _replace_item("response_mask", 3, torch.ones(5)),
            r"response_mask\[3\] has 5 tokens, sample 3 has 3 response",
        ),
        (
            _replace_item("advantages", 1, torch.zeros(4)),
            r"advantages\[1\] has 4 tokens, sample 1 has 5 response",
        ),
        (
            _replace_item("ref_logprobs", 0, torch.zeros(2, dtype=torch.float64)),
            r"ref_logprobs\[0\] must be float32",
        ),
        (
            _replace_item("old_logprobs", 2, torch.zeros(1, 0)),
            r"old_logprobs\[2\] must be a 1-D tensor",
        ),
        (
            _replace_item("tokens", 4, torch.zeros(3, dtype=torch.int32)),
            r"tokens\[4\] must be int64",
        ),
        (
            _replace_item("response_mask", 4, torch.full((1,), 0.5)),
            r"response_mask\[4\] must hold only 0.0 and 1.0",
        ),
        (
            _with(rollout_logprobs=[torch.zeros(2)] * 4),
            "rollout_logprobs must be a list of 5 tensors",
        ),
        (
            _with(prompt_lens=torch.tensor([3, 2, 5, 1, 2])),
            r"prompt_lens\[2\] = 5 must be in \[1, 4\]",
        ),
        (_with(prompt_lens=torch.tensor([0, 2, 4, 1, 2])), r"prompt_lens\[0\] = 0"),
        (
            _with(prompt_lens=torch.tensor(PROMPT_LENS, dtype=torch.int32)),
            "prompt_lens must be torch.int64",
        ),
        (
            _with(group_ids=torch.zeros(6, dtype=torch.int64)),
            r"group_ids must be a tensor of shape \(5,\)",
        ),
        (_with(rewards=torch.zeros(5, dtype=torch.int64)), "rewards must be torch.float32"),
        (_with(sample_ids=torch.tensor([1, 2, 3, 2, 5])), r"sample_ids\[3\] = 2 repeats"),
        (
            _replace_item("routed_experts", 1, torch.zeros(6, 2, 2, dtype=torch.int16)),
            r"routed_experts\[1\] must have shape \(7, num_moe_layers, topk\)",
        ),
        (
            _replace_item("routed_experts", 2, torch.zeros(4, 2, 2, dtype=torch.int64)),
            r"routed_experts\[2\] must be int16",
        ),
        (
            _replace_item("routed_experts", 3, torch.zeros(4, 3, 2, dtype=torch.int16)),
            r"routed_experts\[3\] has \(num_moe_layers, topk\) = \(3, 2\)",
        ),
        (
            _replace_item("routed_experts", 0, torch.full((5, 2, 2), -2, dtype=torch.int16)),
            r"routed_experts\[0\] holds -2",
        ),
        (_with(vision=[None] * 4), "vision must be a list of 5 dicts or None"),
        (
            _replace_item("vision", 3, {"pixel_values": [1.0]}),
            r"vision\[3\] must be None or a non-empty",
        ),
    ],
)
def test_validate_names_field_and_index(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutBatch(**fields)


def test_validate_catches_later_mutation():
    b = make_batch()
    b.advantages[2] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"advantages\[2\] has 1 tokens, sample 2 has 0 response tokens"
    ):
        b.validate()
