"""Reward functions for tests: deterministic and never constant on random models."""


def digit_fraction(response_text: str, label: str, **kwargs) -> float:
    """Fraction of the response's characters that are digits (an arithmetic answer is all digits)."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)
