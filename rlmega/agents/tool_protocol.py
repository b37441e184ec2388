"""The text protocol between a model turn and a tool: `<tool>name:args</tool>` and `<result>text</result>`.

A model turn in a tool loop stops at the stop string CALL_CLOSE, so a turn that calls a tool ends
with one call:

    the sum is <tool>calculator:12+30</tool>

The loop parses it (parse_call), runs the tool (rlmega.agents.tools.run_call) and appends
format_result(output) -- "<result>42</result>", masked out of the loss -- before the next turn.

Every marker uses only characters of the tiny test model's character-level vocabulary
(VOCAB_CHARACTERS): that tokenizer silently drops anything else, so a marker with "[", "_" or an
upper-case letter would reach the model mangled. `to_vocab` brings free text (error messages)
into that alphabet. Pure functions only; nothing here runs a tool.
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_OPEN = "<tool>"
CALL_CLOSE = "</tool>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
NAME_SEPARATOR = ":"
TRUNCATION_MARK = " ...(truncated)"

# The characters of rlmega.demo.tiny_model.CHARACTERS, copied rather than imported: that module pulls
# in torch and transformers, and the protocol must stay cheap to import (tests check they agree).
VOCAB_CHARACTERS = frozenset("0123456789abcdefghijklmnopqrstuvwxyz" + " \n" + "+-*/=()<>.,:;?!'\"")
# Out-of-vocabulary characters with an in-vocabulary stand-in; the rest are dropped.
_VOCAB_STAND_INS = {"[": "(", "]": ")", "{": "(", "}": ")", "_": " ", "\t": " ", "\r": ""}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `name` is "" for a malformed call (no ":" or an empty name); `raw` is the
    whole `<tool>...</tool>` text as the model wrote it."""

    name: str
    args: str
    raw: str

    @property
    def malformed(self) -> bool:
        return self.name == ""


def parse_call(turn_text: str) -> ToolCall | None:
    """The last complete `<tool>NAME:ARGS</tool>` in `turn_text`, or None when there is none.

    The call is split at its first ":" (so ARGS may contain ":"); NAME is stripped of surrounding
    whitespace, ARGS is kept as written. A call with no ":" or an empty name comes back with
    name "" so the loop can answer "error: malformed tool call" instead of ending the trajectory.
    Of nested or repeated openers ("<tool>a <tool>calculator:1</tool>") the innermost one counts.

    The text must contain the closing CALL_CLOSE: a generator that strips its stop string (vLLM's
    default, include_stop_str_in_output=False) must have it put back before parsing.
    """
    end = turn_text.rfind(CALL_CLOSE)
    if end < 0:
        return None
    start = turn_text.rfind(CALL_OPEN, 0, end)
    if start < 0:
        return None
    raw = turn_text[start : end + len(CALL_CLOSE)]
    inner = turn_text[start + len(CALL_OPEN) : end]
    name, sep, args = inner.partition(NAME_SEPARATOR)
    name = name.strip()
    if not sep or not name:
        return ToolCall(name="", args=inner, raw=raw)
    return ToolCall(name=name, args=args, raw=raw)


def format_call(name: str, args: str) -> str:
    """`<tool>name:args</tool>`; parse_call gives (name, args) back. ValueError for a name that
    could not round-trip (empty, padded, containing ":") or args that would close the call early."""
    if not name or name != name.strip() or NAME_SEPARATOR in name or CALL_OPEN in name:
        raise ValueError(
            f"tool name {name!r} must be non-empty, unpadded and contain neither ':' nor {CALL_OPEN!r}"
        )
    if CALL_CLOSE in args or CALL_OPEN in args:
        raise ValueError(f"tool args {args!r} must not contain {CALL_OPEN!r} or {CALL_CLOSE!r}")
    return f"{CALL_OPEN}{name}{NAME_SEPARATOR}{args}{CALL_CLOSE}"


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, ending in TRUNCATION_MARK when it was cut."""
    if len(text) <= max_chars:
        return text
    if max_chars <= len(TRUNCATION_MARK):  # no room for the mark: a plain cut is all that fits
        return text[: max(max_chars, 0)]
    return text[: max_chars - len(TRUNCATION_MARK)] + TRUNCATION_MARK


def escape_markers(text: str) -> str:
    """`text` with a space after the "<" of every protocol marker in it ("</result>" becomes
    "< /result>"), so a tool's output can neither close the result it sits in nor open a call or
    a result. One pass is enough: each marker holds exactly one "<", its first character, so
    breaking one occurrence cannot form another, and cutting the escaped text cannot either."""
    for marker in (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE):
        text = text.replace(marker, f"{marker[0]} {marker[1:]}")
    return text


def format_result(text: str, max_chars: int = 200) -> str:
    """`<result>text</result>`, the text's markers escaped (escape_markers: tool output is written
    by model code) and cut to `max_chars` characters (the cut marked) so one tool answer cannot
    eat the trajectory's token budget."""
    return f"{RESULT_OPEN}{truncate(escape_markers(text), max_chars)}{RESULT_CLOSE}"


def parse_result(text: str) -> str | None:
    """The body of the last `<result>...</result>` in `text`, or None (the inverse of format_result
    for untruncated text without markers; handy for tests and transcripts)."""
    end = text.rfind(RESULT_CLOSE)
    start = text.rfind(RESULT_OPEN, 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len(RESULT_OPEN) : end]


def to_vocab(text: str) -> str:
    """`text` lower-cased, brackets and braces turned into parentheses, "_" into a space, and any
    other character outside VOCAB_CHARACTERS dropped: for free text such as error messages, whose
    exact characters matter less than the model seeing all of them."""
    out = []
    for ch in text.lower():
        if ch in VOCAB_CHARACTERS:
            out.append(ch)
        else:
            out.append(_VOCAB_STAND_INS.get(ch, ""))
    return "".join(out)
