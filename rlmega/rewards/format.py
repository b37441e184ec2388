"""Format rewards: does the response have the shape the task asks for? (the label is not looked at)

Small judgers to weight next to a correctness judger, e.g. math (weight 1) + boxed (weight 0.1):

    boxed(response, label)          1.0 if there is exactly one \\boxed{...}, braces balanced, not empty
    ends_with_eos(response, label)  1.0 if the response ends with the end-of-sequence text (it stopped
                                    by itself rather than being cut off at max_tokens)
    tool_format(response, label)    1.0 if every <tool>...</tool> call is well formed, name:args

Each is `fn(response_text, label, **kwargs) -> float`, addressed by dotted path
(`fn: rlmega.rewards.format.boxed`).
"""

from __future__ import annotations

import re

BOXED = "\\boxed{"
TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def boxed_contents(text: str) -> list[str | None]:
    """The contents of each \\boxed{...} in order; None for one whose braces never close."""
    out: list[str | None] = []
    start = text.find(BOXED)
    while start >= 0:
        i, depth = start + len(BOXED), 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append(text[start + len(BOXED) : i - 1] if depth == 0 else None)
        start = text.find(BOXED, i if depth == 0 else start + len(BOXED))
    return out


def boxed(response_text: str, label=None, **kwargs) -> float:
    """1.0 when the response holds exactly one \\boxed{...}, its braces balanced and its content not
    blank; 0.0 for none, several, an unclosed one or \\boxed{}."""
    found = boxed_contents(response_text)
    return 1.0 if len(found) == 1 and found[0] is not None and found[0].strip() else 0.0


def ends_with_eos(
    response_text: str, label=None, eos: str = "</s>", response_raw: str | None = None, **kwargs
) -> float:
    """1.0 when the response (trailing white space ignored) ends with `eos`, the end-of-sequence token's
    text: read from ``response_raw``, the response with its special tokens (a judger passes it to a function
    that names it; response_text has none), or from response_text when called without it."""
    text = response_text if response_raw is None else response_raw
    return 1.0 if text.rstrip().endswith(eos) else 0.0


def tool_calls(text: str) -> list[str] | None:
    """The bodies of the <tool>...</tool> calls in order; None when the tags do not pair up (an
    unclosed <tool>, a stray </tool>, a <tool> inside another)."""
    calls, pos = [], 0
    while True:
        open_at, close_at = text.find(TOOL_OPEN, pos), text.find(TOOL_CLOSE, pos)
        if open_at < 0:
            return calls if close_at < 0 else None
        end = text.find(TOOL_CLOSE, open_at)
        if close_at < open_at or end < 0:
            return None
        body = text[open_at + len(TOOL_OPEN) : end]
        if TOOL_OPEN in body:
            return None
        calls.append(body)
        pos = end + len(TOOL_CLOSE)


def tool_format(
    response_text: str,
    label=None,
    tools: list[str] | None = None,
    metadata: dict | None = None,
    **kwargs,
) -> float:
    """1.0 when every <tool>...</tool> in the response is `name:args`: the name an identifier (one of
    `tools` when given, e.g. the agent loop's tool list) and args not blank; the tags must pair up.
    A response without tool calls scores 1.0 (nothing is malformed); pair it with a task reward.
    Judged as a judger, it reads a tool loop's whole transcript (metadata["transcript"]): the loop's
    response_text is only the answer after the last tool result."""
    text = (metadata or {}).get("transcript", response_text)
    calls = tool_calls(text)
    if calls is None:
        return 0.0
    for body in calls:
        name, colon, args = body.partition(":")
        name = name.strip()
        if not colon or not TOOL_NAME.fullmatch(name) or not args.strip():
            return 0.0
        if tools is not None and name not in tools:
            return 0.0
    return 1.0
