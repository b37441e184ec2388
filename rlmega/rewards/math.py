"""Math answers checked by math-verify: `reward.fn: rlmega.rewards.math.score`.

    score("The answer is $\\boxed{\\frac{1}{2}}$", "0.5")    # 1.0
    score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")                # 1.0: compared as sympy expressions
    score("so x = 3", "3")                                   # 1.0
    score("\\boxed{3}", "4")                                 # 0.0

The response is parsed with math-verify's LaTeX and plain-expression extractors, a \\boxed{...} first
(boxed_match_priority=0: a boxed answer beats other numbers in the text), then "final answer is ..."
forms, then the last expression. The label is the gold answer: one with "$" or "\\boxed" is parsed as
written; a bare one ("0.5", "\\sqrt{8}", "x=3") is parsed as the LaTeX math "$label$" (so "\\sqrt{8}"
and "1+x^2" keep their meaning instead of being read as their last number), else as a plain expression.
A label that parses to nothing raises ValueError: that is a data error to flag, not a wrong answer.

math-verify bounds its own parsing and comparison with signal.alarm, which works only in a process's
main thread (elsewhere it logs an error and returns "no match": a silent 0). Judgers and RewardWorker
call reward functions from worker threads, so there those bounds are off and the caller's timeout_s
bounds the call instead (its thread is abandoned past it).
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

ANSWER_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
MAIN_THREAD_TIMEOUT_S = 5  # math-verify's default per parse / comparison


def _timeout() -> int | None:
    return MAIN_THREAD_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(label) -> list:
    """math-verify's parse of the reference answer (rules in the module doc); [] when nothing parses."""
    text = str(label).strip()
    if not text:
        return []
    if "$" in text or "\\boxed" in text:
        return parse(text, GOLD_CONFIG, parsing_timeout=_timeout())
    return parse(f"${text}$", GOLD_CONFIG, parsing_timeout=_timeout()) or parse(
        text, GOLD_CONFIG, parsing_timeout=_timeout()
    )


def score(
    response_text: str, label, float_rounding: int = 6, strict: bool = True, **kwargs
) -> float:
    """1.0 when the response's answer equals the label mathematically, else 0.0.

    float_rounding and strict are math-verify's `verify` options (decimal places compared; strict=False
    lets e.g. a variable-free equation match its value). Other keyword arguments are ignored.
    """
    gold = parse_gold(label)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {label!r}")
    answer = parse(response_text, ANSWER_CONFIG, parsing_timeout=_timeout())
    if not answer:
        return 0.0
    return (
        1.0
        if verify(
            gold, answer, float_rounding=float_rounding, strict=strict, timeout_seconds=_timeout()
        )
        else 0.0
    )
