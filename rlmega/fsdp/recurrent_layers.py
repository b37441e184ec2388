"""Linear-attention (recurrent) layers over packed rows: each sequence of the row runs alone.

    n = recurrent_layers.per_sequence(model, "linear_attn")   # at build, before fully_shard; n modules wrapped

A gated delta-net layer (Qwen3-Next) carries a recurrent state and a short causal convolution along the
row. transformers' torch path has no notion of packed sequences (it drops ``cu_seqlens``), so a packed
row would hand the state of one sample to the next: measured 0.075 off on the second sequence's logits
of a tiny Qwen3-Next, with no error. Here each decoder layer holding such a module reads the row's
sequence bounds from its ``position_ids`` (a forward pre-hook: it runs again when activation
checkpointing recomputes the layer), and the module runs once per sequence from a zero state, exactly
as for that sequence alone; the outputs are concatenated back into the row.
"""

from __future__ import annotations

import torch

from rlmega.fsdp.packed_attention import sequence_bounds


def _bounds_hook(recurrent: torch.nn.Module):
    def hook(layer, args, kwargs):
        pos = kwargs.get("position_ids")
        recurrent._rlmega_bounds = (
            None if pos is None or pos.shape[0] != 1 else sequence_bounds(pos)
        )

    return hook


def _per_sequence_forward(module: torch.nn.Module):
    inner = module.forward

    def forward(hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
        bounds = getattr(module, "_rlmega_bounds", None)
        if bounds is None or len(bounds) == 1:
            return inner(
                hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
            )
        if cache_params is not None or (
            attention_mask is not None and not bool(attention_mask.all())
        ):
            raise ValueError(
                "a packed row through a linear-attention layer takes no cache and no padding mask"
            )
        kwargs = {
            k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))
        }
        parts = hidden_states.split([e - s for s, e in bounds], dim=1)
        return torch.cat(
            [inner(p, cache_params=None, attention_mask=None, **kwargs) for p in parts], dim=1
        )

    return forward


def per_sequence(model: torch.nn.Module, attribute: str) -> int:
    """Make every decoder layer's ``attribute`` submodule (a linear-attention layer) run per packed
    sequence; returns how many were wrapped (0: the model has none, which the caller treats as an error)."""
    n = 0
    for layer in model.modules():
        recurrent = getattr(layer, attribute, None)
        if isinstance(recurrent, torch.nn.Module) and recurrent is not layer:
            layer.register_forward_pre_hook(_bounds_hook(recurrent), with_kwargs=True)
            recurrent.forward = _per_sequence_forward(recurrent)
            n += 1
    return n


def restart_at_sequences(model: torch.nn.Module) -> int:
    """Wrap the linear-attention modules the family table names for ``model``'s family (causal LM or a
    critic's body: looked up by model_type); returns how many (0 for a family without them)."""
    from rlmega.config.families import family

    fam = family({"model_type": model.config.model_type})
    if fam is None or not fam.recurrent:
        return 0
    n = per_sequence(model, fam.recurrent)
    if not n:  # the table names a module the model lacks: transformers renamed it
        raise RuntimeError(
            f"{fam.architecture}: no decoder layer has a {fam.recurrent!r} module to run per packed "
            "sequence (rlmega/config/families.py names it); refusing to train with state crossing "
            "sequences"
        )
    return n
