"""Rule-based reward for the synthetic addition task (rlmega.data.arithmetic).

The prompt ends with "="; the response is correct when it opens with exactly the answer's digits,
followed by anything that is not a digit (an EOS token, a space, a newline) or by nothing.
"""

from __future__ import annotations

DIGITS = frozenset("0123456789")  # ASCII only: str.isdigit would also accept "²" or "٣"


def score(response_text: str, label: str, **kwargs) -> float:
    """1.0 if `response_text` starts with the digits of `label` not followed by another digit, else 0.0.

    "46", "46</s>", "46 and more" score 1.0 against label "46"; "461", "4", "", " 46", "x46" score 0.0.
    Extra keyword arguments (reward.kwargs) are accepted and ignored.
    """
    answer = str(label).strip()
    if not answer:
        return 0.0
    if not response_text.startswith(answer):
        return 0.0
    rest = response_text[len(answer) :]
    return 0.0 if rest[:1] in DIGITS else 1.0
