"""Supervised warm-start targets in an agent loop's own format.

Single turn: the label, then EOS. Tool loop with the calculator, on prompts that are an expression
ending in "=" (the synthetic arithmetic task): the call, its real result (masked: the loop appends it,
the model never writes it), then the label and EOS:

    "12+34="  ->  "<tool>calculator:12+34</tool>" + ["<result>46</result>", masked] + "46</s>"
"""

from __future__ import annotations

from rlmega.agents.tool_protocol import format_call, format_result
from rlmega.agents.tools import get_tool


def sft_segments(prompt_text: str, label, loop_cfg) -> list[tuple[str, bool]]:
    """[(text, trained?)] of the target response for one prompt."""
    answer = [(str(label), True)]
    expr = prompt_text.rstrip()
    if loop_cfg.kind == "tool" and "calculator" in loop_cfg.tools and expr.endswith("="):
        expr = expr[:-1]
        result = get_tool("calculator").run(expr, loop_cfg.tool_timeout_s, loop_cfg.tool_memory_mb)
        return [(format_call("calculator", expr), True), (format_result(result), False)] + answer
    return answer


def sft_example(
    prompt_ids: list[int], prompt_text: str, label, loop_cfg, tokenizer
) -> tuple[list[int], list[float]]:
    """(response token ids ending in EOS, their loss mask) for one prompt: each segment tokenized once."""
    ids, mask = [], []
    for text, trained in sft_segments(prompt_text, label, loop_cfg):
        seg = tokenizer.encode(text, add_special_tokens=False)
        ids += seg
        mask += [1.0 if trained else 0.0] * len(seg)
    return ids + [tokenizer.eos_token_id], mask + [1.0]
