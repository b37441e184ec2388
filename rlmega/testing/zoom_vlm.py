"""A tiny vision-language model that has learned to call the zoom tool, for tests of image observations.

A random tiny VLM almost never writes "<tool>zoom:...</tool>", so a test of a multi-turn loop with image
observations would see none. This one is the tiny Idefics3 of rlmega.demo.tiny_vlm after a short supervised
training (transformers, float32, CPU) on the colour task's prompts (rlmega/data/shapes.py) -> a zoom call on
the image's middle: "<tool>zoom:25 25 75 75</tool>" (one box: after 120 steps the model writes it whole at
temperature 1 most of the time; with four boxes to pick from it often mangled the numbers). Only the first turn is
taught; what it writes after the zoomed image comes back is up to it (often another call).

    path = make_zoom_vlm(tmp_path / "zoom_vlm")   # 120 steps, ~15 s on 2 cores
"""

from __future__ import annotations

from pathlib import Path

import torch

BOX = "25 25 75 75"


def make_zoom_vlm(
    out_dir, steps: int = 120, batch: int = 8, lr: float = 3e-3, seed: int = 0
) -> Path:
    from transformers import AutoModelForImageTextToText

    from rlmega.agents.tool_protocol import format_call
    from rlmega.data.images import load_processor, processor_vision
    from rlmega.data.shapes import shape_rows
    from rlmega.demo.tiny_vlm import make_tiny_vlm

    path = make_tiny_vlm(out_dir, arch="idefics3", seed=seed, overwrite=True)
    proc = load_processor(str(path))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in shape_rows(64, seed=seed + 1):
        text = proc.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        vision, prompt = processor_vision(proc, text, row["images"])
        target = proc.tokenizer(format_call("zoom", BOX), add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor(prompt + target), len(prompt), vision))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = 0.0
            for i in torch.randint(len(rows), (batch,), generator=g).tolist():
                ids, plen, vision = rows[i]
                logits = model(input_ids=ids[None], **vision).logits[0, plen - 1 : -1]
                loss = loss + torch.nn.functional.cross_entropy(logits, ids[plen:]) / batch
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)
