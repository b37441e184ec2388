"""Tiny models whose weights are moved off their initial values, for parity tests: a norm left at 1 or a bias at 0
agrees with a wrong implementation that forgets it, a moved one does not.

    folder = moved_off_init(make_tiny_model(root / "raw", ...), root / "model", seed=3)
"""

from __future__ import annotations

from pathlib import Path

import torch


def moved_off_init(raw: str | Path, out: str | Path, seed: int, scale: float = 0.05) -> str:
    """The model in folder ``raw`` with N(0, ``scale``) added to every parameter (seeded by ``seed``), saved
    with its tokenizer into ``out``; returns ``out``."""
    from transformers import AutoModelForCausalLM

    raw, out = Path(raw), Path(out)
    model = AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out)
    for f in raw.iterdir():
        if f.name.startswith(("tokenizer", "special", "chat")):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)
