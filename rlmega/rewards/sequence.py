"""Rule-based reward for the long-answer sequence task (rlmega.data.sequences).

The label is the whole answer, e.g. "cvdrlt..." (the letters after the prompt's start letter in the task's
order). The order's successor map is read off the label itself (27 letters or more hold every successor of
the 26). The score is the fraction of the label's positions the response gets right: position 0 must be
the label's first letter and position i > 0 the successor of the response's letter i - 1, so a letter gone
wrong costs one position, not the rest of the answer. Missing positions (a short response) are wrong.
"""

from __future__ import annotations


def score(response_text: str, label: str, **kwargs) -> float:
    """Fraction in [0, 1] of the label's positions that follow the order.

    With label "abcab" (a -> b -> c -> a): score("abcab") == 1.0; score("abbca") == 0.8 (position 2 is
    wrong, 3 and 4 follow the b); score("abc") == 0.6; score("") == 0.0. Extra keyword arguments
    (reward.kwargs) are accepted and ignored.
    """
    label = str(label)
    if not label:
        raise ValueError("the label is empty: a sequence answer has at least one letter")
    successor = dict(zip(label, label[1:]))
    text = response_text[: len(label)]
    right = int(text[:1] == label[0])
    for prev, cur in zip(text, text[1:]):
        right += successor.get(prev) == cur
    return right / len(label)
