"""How a judge model's answer is read (rlmega/judgers/model.py uses it; the rule of its prompt_template,
check_template, is a config rule: rlmega/config/judger_rules.py).

Kept apart from model.py so the verdict rule is read (and tested) without importing Ray or vLLM.

Reading the verdict (`parse_verdict`), on the decoded text with leading white space removed:
  1. it starts with a number ("0.8", "1", ".5"): that number is the reward if it lies in [0, 1], else 0;
  2. otherwise its first word, lower-cased, is "yes" or "y": reward 1;
  3. anything else (including an empty answer): reward 0.
So "0.75 because" -> 0.75, "1" -> 1.0, "12" -> 0.0, "Yes." -> 1.0, "y3" -> 1.0, "no" -> 0.0.
A judge prompted to answer with a probability or with yes/no both fit; ask for a short answer.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_WORD = re.compile(r"[a-z]+")


def parse_verdict(text: str) -> float:
    """The judge's reward from its text (rules in the module doc)."""
    text = text.lstrip()
    number = _NUMBER.match(text)
    if number:
        value = float(number.group())
        return value if 0.0 <= value <= 1.0 else 0.0
    word = _WORD.match(text.lower())
    return 1.0 if word and word.group() in ("yes", "y") else 0.0
