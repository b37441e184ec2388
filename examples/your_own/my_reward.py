"""A reward function of one's own, for configs/your_own_cpu.yaml (docs/your_own.md).

reward.fn: examples/your_own/my_reward.py:exact_match names it: a file path, then the function. rlmega calls
it once per trajectory with the response decoded without special tokens and the row's label; a parameter
named for one of the row's other columns ("region" here) gets that column, and ``prompt`` the prompt's text.
"""


def exact_match(response_text: str, label: str, **kwargs) -> float:
    """1.0 when the response, stripped of surrounding white space, is the label."""
    return float(response_text.strip() == label)


def exact_match_europe_counts_double(
    response_text: str, label: str, region: str = "", **kwargs
) -> dict:
    """The same check, with the row's "region" column by name and a second named score in the metrics."""
    right = float(response_text.strip() == label)
    return {"reward": right * (2.0 if region == "europe" else 1.0), "right": right}
