"""Reward functions for tests: deterministic and never constant on random models."""

import inspect


def digit_fraction(response_text: str, label: str, **kwargs) -> float:
    """Fraction of the response's characters that are digits (an arithmetic answer is all digits)."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def digit_fraction_raw(response_text: str, label: str, response_raw: str, **kwargs) -> float:
    """digit_fraction of the response with its special tokens ("46</s>": 0.33), what response_text held before
    issue 56 (tests/e2e/test_train.py's golden file was recorded with it)."""
    return digit_fraction(response_raw, label)


def flaky(response_text: str, label: str, **kwargs) -> float:
    """1.0, but raises on a label "raise", sleeps ``hang_s`` on "hang" and returns text on "text"."""
    if label == "raise":
        raise ZeroDivisionError("label says raise")
    if label == "hang":
        import time

        time.sleep(kwargs.get("hang_s", 5.0))
    if label == "text":
        return "not a number"
    return 1.0


def _raising_line(fn, text: str) -> str:
    lines, first = inspect.getsourcelines(fn)
    return f"{inspect.getsourcefile(fn)}:{first + next(i for i, line in enumerate(lines) if text in line)}"


# what a judger's error names (issue 56)
FLAKY_RAISES_AT = _raising_line(flaky, "raise ZeroDivisionError")


def faulty_arithmetic(response_text: str, label: str, hang_s: float = 30.0, **kwargs) -> float:
    """digit_fraction, except that it raises when the response's length is a multiple of 3 and hangs
    for ``hang_s`` when it is 1 more than a multiple of 3: user code failing on some inputs of a run."""
    if len(response_text) % 3 == 0:
        raise KeyError(f"no rule for {response_text!r}")
    if len(response_text) % 3 == 1:
        import time

        time.sleep(hang_s)
    return digit_fraction(response_text, label)


def digit_fraction_or_one(response_text: str, label: str, **kwargs) -> float:
    """1.0 for every response to a prompt whose label ends in 0-4 (such groups are uniform: DAPO's dynamic
    sampling drops them), digit_fraction otherwise."""
    if str(label)[-1:] in "01234":
        return 1.0
    return digit_fraction(response_text, label)
