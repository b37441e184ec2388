"""Rule-based arithmetic reward and dotted-path resolution of reward functions."""

import pytest

from rlmega.rewards import RewardResolveError, resolve
from rlmega.rewards.arithmetic import score


@pytest.mark.parametrize(
    "response,expected",
    [
        ("46", 1.0),
        ("46</s>", 1.0),
        ("46 and then some", 1.0),
        ("46\n12+3=", 1.0),
        ("46.", 1.0),
        ("461", 0.0),
        ("4", 0.0),
        ("", 0.0),
        ("x46", 0.0),
        (" 46", 0.0),
        ("47", 0.0),
        ("046", 0.0),
        ("46\u00b2", 1.0),  # a superscript two is not an ASCII digit
    ],
)
def test_arithmetic_score(response, expected):
    assert score(response, "46") == expected


def test_arithmetic_score_label_forms_and_kwargs():
    assert score("46", 46) == 1.0  # numeric labels (e.g. from JSON) compare by their text
    assert score("46", " 46\n") == 1.0
    assert score("0", "0") == 1.0 and score("00", "0") == 0.0
    assert score("46", "") == 0.0 and score("", "") == 0.0  # an empty label never matches
    assert score("46", "46", tolerance=0.5, anything="else") == 1.0  # reward.kwargs are accepted
    assert isinstance(score("46", "46"), float)


def test_arithmetic_score_agrees_with_the_synthetic_task():
    from rlmega.data.prompts import synthetic_arithmetic_rows

    for row in synthetic_arithmetic_rows(50, digits=3, seed=4):
        assert score(row["label"] + "</s>", row["label"]) == 1.0
        assert score(row["label"] + "9", row["label"]) == 0.0


def test_resolve_the_default_reward():
    from rlmega.config import RLConfig

    assert resolve(RLConfig().reward.fn) is score
    assert resolve("os.path.join") is __import__("os").path.join
    assert resolve("collections.OrderedDict.fromkeys")  # a class attribute after the module


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A throwaway importable package with a good module, one that fails to import, and a constant."""
    root = tmp_path / "rwpkg_test"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "good.py").write_text(
        "THRESHOLD = 0.5\n\ndef reward(text, label, **kw):\n    return 1.0\n"
    )
    (root / "needs_dep.py").write_text(
        "import surely_not_installed_dep\n\ndef reward(text, label):\n    return 1.0\n"
    )
    (root / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rwpkg_test"


def resolve_error(path):
    with pytest.raises(RewardResolveError) as e:
        resolve(path)
    msg = str(e.value)
    assert msg.startswith(f"reward.fn={path!r}: ") and "Fix:" in msg, msg
    assert isinstance(e.value, ValueError)
    return msg


def test_resolve_errors_name_the_path_and_the_failure(pkg):
    assert resolve(f"{pkg}.good.reward")("x", "y") == 1.0
    assert "is not a dotted path" in resolve_error("score")
    assert "is not a dotted path" in resolve_error("rlmega..score")
    assert "module 'no_such_pkg_xyz.mod' not found" in resolve_error("no_such_pkg_xyz.mod.fn")
    assert f"module '{pkg}.missing' not found" in resolve_error(f"{pkg}.missing.reward")
    msg = resolve_error(f"{pkg}.needs_dep.reward")
    assert f"importing module '{pkg}.needs_dep' failed" in msg and "surely_not_installed_dep" in msg
    msg = resolve_error(f"{pkg}.raises.reward")
    assert "RuntimeError: boom at import" in msg
    msg = resolve_error(f"{pkg}.good.rewrd")
    assert (
        f"'{pkg}.good' has no attribute 'rewrd'" in msg
        and f"did you mean {pkg}.good.reward?" in msg
    )
    msg = resolve_error(f"{pkg}.good.THRESHOLD")
    assert f"'{pkg}.good.THRESHOLD' is a float, not a callable" in msg


def test_resolve_uses_a_custom_field_name():
    with pytest.raises(RewardResolveError, match=r"^judge\.fn='x': "):
        resolve("x", field="judge.fn")


@pytest.mark.parametrize(
    "response,expected",
    [
        ("abcab", 1.0),
        ("abcab</s>", 1.0),
        ("abbca", 0.8),
        ("abc", 0.6),
        ("", 0.0),
        ("bbcab", 0.6),
        ("abxab", 0.6),
        ("abcabcabca", 1.0),  # past the label's length nothing counts
    ],
)
def test_sequence_score(response, expected):
    from rlmega.rewards.sequence import score as sequence_score

    assert sequence_score(response, "abcab") == pytest.approx(expected)


def test_sequence_score_agrees_with_the_synthetic_task_and_refuses_an_empty_label():
    from rlmega.data.sequences import cycle, make_sequence_problems
    from rlmega.rewards.sequence import score as sequence_score

    for prompt, answer in make_sequence_problems(20, 300, seed=5):
        order = cycle(5)
        assert answer[0] == order[(order.index(prompt[0]) + 1) % 26]
        assert sequence_score(answer, answer) == 1.0
        assert sequence_score(answer[:150], answer) == 0.5
        # first letter skipped, last missing
        assert sequence_score(answer[1:], answer) == pytest.approx(298 / 300)
    with pytest.raises(ValueError, match="label is empty"):
        sequence_score("ab", "")
