"""Reward of the synthetic colour task (rlmega/data/shapes.py): the response names the shapes' colour (the label:
its initial, "b" for blue).

The response is correct when it opens with exactly the label's word, followed by anything that is not a letter (an
EOS token, a space, a full stop) or by nothing: "b" and "b</s>" score 1 against "b", "blue" scores 0.
"""

from __future__ import annotations


def score(response_text: str, label: str, **kwargs) -> float:
    """1.0 if `response_text` starts with the word `label` not followed by another letter, else 0.0.

    "blue", "blue</s>", "blue." score 1.0 against "blue"; "bluey", "blu", " blue", "" score 0.0. Extra keyword
    arguments (reward.kwargs) are accepted and ignored.
    """
    answer = str(label).strip()
    if not answer or not response_text.startswith(answer):
        return 0.0
    return 0.0 if response_text[len(answer) :][:1].isalpha() else 1.0
