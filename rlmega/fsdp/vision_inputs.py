"""Images in a packed row: the vision keyword arguments of one forward of a vision-language model.

A packed row holds several samples (rlmega/data/micro_batches.py); some carry images. Each sample's
processor outputs (``pixel_values`` and the family's image layout) are kept per sample, so packing can
put them together in the row's sample order: transformers' VLM classes scatter image features into
the image-token positions of the row in order, so sample k's images must come after sample k-1's.

Per family:
- Idefics3 / SmolVLM: ``pixel_values`` (1, images, 3, H, W) and ``pixel_attention_mask`` (1, images, H, W),
  joined along the image axis (tiles of other sizes padded, their mask False where padded).
- Qwen2-VL / Qwen2.5-VL: ``pixel_values`` (patches, C * T * P * P) and ``image_grid_thw`` (images, 3),
  joined along the first axis; and 3-D rotary positions (mRoPE), computed per sequence: transformers' own
  ``get_rope_index`` on each sample's tokens, so every sequence's positions start at 0 as they do
  unpacked and in vLLM. The row goes in as ``position_ids`` (4, 1, T): row 0 the text positions (they
  also mark the sequences for the attention: rlmega/fsdp/packed_attention.py), rows 1-3 (t, h, w).
  Text-only rows of a Qwen2-VL model get the same four rows (all text positions), or the attention
  would see one sequence.

Image placeholders the policy *sampled* (a response may hold the image token: it is in the vocabulary) are
text: vLLM puts image features only where the prompt's placeholders are, and embeds a sampled one as a token.
transformers' VLM classes would take every image token of the row for an image position (and fail, or take
features from the next sample). So a row's sampled placeholders go into the model as another id (pad), and
``sampled_placeholders_as_text`` makes the embedding layer embed the row's true ids: those tokens keep their
own embedding, and only the prompts' placeholders receive image features. mRoPE counts only the prompt's.
An image a tool answered with (an image observation, rlmega/agents/image_observations.py) lies in the response
too: a sequence's ``observation_spans`` name those placeholders, which receive features like the prompt's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from rlmega.data.rollout_batch import OBSERVATION_SPANS
from rlmega.fsdp.packed_attention import sequence_bounds

IDEFICS3_TYPES = ("idefics3", "smolvlm")
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")
VLM_TYPES = IDEFICS3_TYPES + MROPE_TYPES
# the transformers auto class that builds every VLM_TYPES model
VLM_AUTO_CLASS = "AutoModelForImageTextToText"

# rope_index(input_ids (1, t), mm_token_type_ids (1, t), image_grid_thw (n, 3)) -> (positions (3, 1, t), deltas)
RopeIndex = Callable[..., tuple]


def is_vlm(config) -> bool:
    """A model config with a vision tower (a composite config with ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


# The vision tower's module (an attribute of the VLM's inner model) per family: what freeze_vision_tower freezes.
VISION_TOWERS = {
    "idefics3": "vision_model",
    "smolvlm": "vision_model",
    "qwen2_vl": "visual",
    "qwen2_5_vl": "visual",
}


def vision_tower_names(model) -> set[str]:
    """The parameter names (model.named_parameters()) of a VLM's vision tower; empty for a text-only model."""
    if not is_vlm(model.config):
        return set()
    check_supported(model.config)
    tower = getattr(model.model, VISION_TOWERS[model.config.model_type])
    mine = {id(p) for p in tower.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in mine}


def check_supported(config) -> None:
    """Refuse a VLM family whose image inputs this module cannot pack, naming the supported ones."""
    if is_vlm(config) and config.model_type not in VLM_TYPES:
        raise ValueError(
            f"model.path is a {config.model_type} vision-language model; the FSDP learner packs images "
            f"for {', '.join(VLM_TYPES)} only. Fix: use one of those families, or a text-only model"
        )


def _cat_padded_tiles(
    values: list[torch.Tensor], masks: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Idefics3 tiles (1, n_i, 3, H_i, W_i) and masks (1, n_i, H_i, W_i) -> one (1, sum n, 3, H, W) and mask."""
    H = max(v.shape[-2] for v in values)
    W = max(v.shape[-1] for v in values)
    pv = torch.cat(
        [torch.nn.functional.pad(v, (0, W - v.shape[-1], 0, H - v.shape[-2])) for v in values],
        dim=1,
    )
    pm = torch.cat(
        [torch.nn.functional.pad(m, (0, W - m.shape[-1], 0, H - m.shape[-2])) for m in masks], dim=1
    )
    return pv, pm


def placeholder_ids(config) -> list[int]:
    """The token ids a VLM fills with image (or video) features."""
    return [
        i
        for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
        if i is not None
    ]


def sampled_placeholders(
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    config,
    prompt_ends: Sequence[int] | None,
    per_seq: Sequence[dict | None] = (),
) -> torch.Tensor:
    """(T,) bool: the row's image placeholders that lie after their sequence's prompt (sampled, so text), but
    for those of an image observation a tool put in the response (each sequence's ``observation_spans``).

    tokens, position_ids (1, T): the packed row; prompt_ends: each sequence's first response position in the
    row, in row order (None: every token is prompt); per_seq: each sequence's vision inputs, in row order."""
    row = tokens.reshape(-1)
    in_response = torch.zeros_like(row, dtype=torch.bool)
    for k, ((_, end), prompt_end) in enumerate(
        zip(sequence_bounds(position_ids), prompt_ends or [])
    ):
        in_response[prompt_end:end] = True
        vision = per_seq[k] if k < len(per_seq) else None
        for a, b in (
            (vision or {}).get(OBSERVATION_SPANS, torch.zeros(0, 2, dtype=torch.int64)).tolist()
        ):
            # an image observation: its features go there
            in_response[prompt_end + a : prompt_end + b] = False
    return in_response & torch.isin(row, torch.tensor(placeholder_ids(config), device=row.device))


def mrope_position_ids(
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    per_seq: Sequence[dict | None],
    image_token_id: int,
    rope_index: RopeIndex,
    text_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(4, 1, T) position ids of a packed row for an mRoPE model.

    tokens, position_ids (1, T): the packed row (positions restart at 0 per sequence); per_seq: each
    sequence's vision inputs (None: text only), in row order; rope_index: the model's get_rope_index;
    text_mask (T,) bool: placeholders to count as text (sampled ones, ``sampled_placeholders``)."""
    text = position_ids.reshape(1, -1)
    out = text.expand(3, -1).clone()  # text tokens: the same position on all three axes
    bounds = sequence_bounds(text)
    if len(bounds) < len(per_seq):
        raise ValueError(
            f"{len(per_seq)} samples' vision inputs for a row of {len(bounds)} sequences"
        )
    for (s, e), vision in zip(bounds, per_seq):
        if vision is None:
            continue
        ids = tokens.reshape(1, -1)[:, s:e]
        mm = (ids == image_token_id).to(torch.int32)
        if text_mask is not None:
            mm[0, text_mask[s:e]] = 0
        pos, _ = rope_index(ids, mm_token_type_ids=mm, image_grid_thw=vision["image_grid_thw"])
        out[:, s:e] = pos[:, 0].to(out.dtype)
    return torch.cat([text, out], dim=0)[:, None, :]


def row_vision_kwargs(
    config,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    per_seq: Sequence[dict | None],
    rope_index: RopeIndex | None = None,
    prompt_ends: Sequence[int] | None = None,
) -> dict:
    """Keyword arguments for ``model(**kwargs)`` over one packed row: ``input_ids`` and ``position_ids`` (the
    row's (1, T), or mRoPE's (4, 1, T)), and a VLM's images. per_seq: each sequence's processor outputs without
    the tokens (None for a text-only sample), in the row's order; prompt_ends: where each sequence's prompt ends
    (sampled image placeholders after it are text: ``input_ids`` then holds pad there, and the caller embeds
    ``tokens`` with ``sampled_placeholders_as_text``). A text-only model: the tokens and positions as given."""
    if not is_vlm(config):
        return {"input_ids": tokens, "position_ids": position_ids}
    check_supported(config)
    have = [v for v in per_seq if v is not None]
    as_text = sampled_placeholders(tokens, position_ids, config, prompt_ends, per_seq)
    pad = getattr(config.get_text_config(), "pad_token_id", None) or 0
    kwargs: dict = {
        "input_ids": tokens.masked_fill(as_text.reshape(tokens.shape), pad),
        "position_ids": position_ids,
    }
    if config.model_type in MROPE_TYPES:
        if rope_index is None:
            raise ValueError("an mRoPE model's packed row needs its get_rope_index (rope_index=)")
        kwargs["position_ids"] = mrope_position_ids(
            tokens, position_ids, per_seq, config.image_token_id, rope_index, as_text
        )
        if have:
            kwargs["pixel_values"] = torch.cat([v["pixel_values"] for v in have], dim=0)
            kwargs["image_grid_thw"] = torch.cat([v["image_grid_thw"] for v in have], dim=0)
    elif have:
        kwargs["pixel_values"], kwargs["pixel_attention_mask"] = _cat_padded_tiles(
            [v["pixel_values"] for v in have], [v["pixel_attention_mask"] for v in have]
        )
    return kwargs


@contextmanager
def sampled_placeholders_as_text(model, tokens: torch.Tensor, input_ids: torch.Tensor):
    """While open, the model's input embedding embeds ``tokens`` (the row's true ids) whatever ids it is given
    (``input_ids``: the same, sampled placeholders swapped for pad so that the VLM puts no image there). The
    override is the layer's own ``forward`` on this instance (as forward.hidden_out), so FSDP's hooks around
    the layer still gather its weight. Nothing changes when no placeholder was sampled."""
    if torch.equal(tokens, input_ids):
        yield
        return
    emb = model.get_input_embeddings()
    own = type(emb).forward

    def forward(ids, *args, **kwargs):
        if ids.shape != tokens.shape:
            raise ValueError(
                f"embedding of ids {tuple(ids.shape)} while the row is {tuple(tokens.shape)}"
            )
        return own(emb, tokens.to(ids.device), *args, **kwargs)

    emb.forward = forward
    try:
        yield
    finally:
        del emb.forward


def load_kwargs(config, attention: str) -> tuple[type, dict]:
    """(transformers auto class, from_pretrained keyword arguments) of a model config whose language model's
    attention is ``attention`` (rlmega/fsdp/packed_attention.py's name for packed rows).

    A VLM is built by AutoModelForImageTextToText, its language model with ``attention`` and its vision tower
    with sdpa: a vision tower attends over all patches of an image at once, which per-sequence causal
    attention would get wrong."""
    import transformers

    if not is_vlm(config):
        return transformers.AutoModelForCausalLM, {"attn_implementation": attention}
    check_supported(config)
    per_part = {"": attention, "text_config": attention, "vision_config": "sdpa"}
    return getattr(transformers, VLM_AUTO_CLASS), {"attn_implementation": per_part}
