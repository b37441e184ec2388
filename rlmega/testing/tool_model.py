"""A tiny model that has learned the calculator tool format, for agent-loop tests.

A random tiny model almost never writes "<tool>...</tool>", so a test of the multi-turn loop would
see no tool call. This one is the tiny Qwen2 of rlmega.demo.tiny_model after a few hundred steps of plain
supervised training (transformers, float32, CPU, seconds) on targets in the agent loop's own format
(rlmega.agents.sft): "12+34=" -> "<tool>calculator:12+34</tool>" [<result>46</result>] "46</s>", the
result masked. Sampling at temperature 1 it calls the tool in most trajectories, sometimes badly: 15 of
16 in tests/e2e/test_agent_loops.py after 300 steps; after 150 (the earlier default) it was 7 here,
below that test's 8 (how well the format sits after a short training depends on float summation order).

    path = make_tool_model(tmp_path / "tool_model")   # 300 steps, ~18 s on 2 cores
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_tool_model(
    out_dir, steps: int = 300, batch: int = 16, lr: float = 3e-3, seed: int = 0
) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlmega.agents.sft import sft_example
    from rlmega.config.schema import AgentLoopConfig
    from rlmega.data.arithmetic import make_problems
    from rlmega.demo.tiny_model import make_tiny_model

    path = make_tiny_model(
        out_dir,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        seed=seed,
        overwrite=True,
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loop = AgentLoopConfig(kind="tool", tools=["calculator"])
    rows = []
    for prompt, answer in make_problems(2000, digits=2, seed=seed + 1):
        p = tok.encode(prompt)
        ids, mask = sft_example(p, prompt, answer, loop, tok)
        rows.append((p + ids, [0.0] * len(p) + mask))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            pick = torch.randint(len(rows), (batch,), generator=g).tolist()
            width = max(len(rows[i][0]) for i in pick)
            ids = torch.zeros(batch, width, dtype=torch.long)
            weight = torch.zeros(batch, width)
            for r, i in enumerate(pick):
                ids[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
                weight[r, : len(rows[i][1])] = torch.tensor(rows[i][1])
            logits = model(ids).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view(batch, -1)
            loss = (nll * weight[:, 1:]).sum() / weight[:, 1:].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)
