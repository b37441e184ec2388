"""Judgers in one process: the built-in math and format rewards, NativeJudger's timeouts and errors,
CompositeJudger's weighting, build_judger, validate_judgers and the model judge's verdict rule.
Ray, HTTP and model judgers run in tests/e2e/test_judgers_ray.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest


from rlmega.config.schema import JudgerConfig, RewardConfig
from rlmega.config.validate import ConfigError
from rlmega.judgers import (
    CompositeJudger,
    Judgement,
    Judger,
    JudgeItem,
    build_judger,
    validate_judgers,
)
from rlmega.judgers.native import NativeJudger
from rlmega.testing.rewards import FLAKY_RAISES_AT
from rlmega.judgers.verdict import parse_verdict
from rlmega.rewards import BUILT_IN, resolve
from rlmega.rewards import format as fmt
from rlmega.rewards.math import score as math_score


def item(response: str, label="46", **kw) -> JudgeItem:
    return JudgeItem(prompt_text="q=", response_text=response, label=label, **kw)


def run(coro):
    return asyncio.run(coro)


# ---- rlmega.rewards.math: math-verify on real answer strings ------------------------------------
@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$", "1/2", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("We get $x^2+1$, so \\boxed{x^2+1}", "1+x^2", 1.0),
        ("so x = 3", "3", 1.0),
        ("x = 3", "x = 3", 1.0),
        ("3", "x=3", 1.0),
        ("The final answer is 42.", "42", 1.0),
        ("I first thought 7, but the final answer is 8", "8", 1.0),
        ("\\boxed{8}, and 7 is wrong", "8", 1.0),  # a boxed answer beats a later number
        ("46</s>", 46, 1.0),  # a numeric label (JSON) and an EOS token after the answer
        ("The answer is $\\boxed{\\frac{1}{3}}$", "0.5", 0.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}", 0.0),
        ("x = 4", "3", 0.0),
        ("no idea", "8", 0.0),
        ("", "8", 0.0),
    ],
)
def test_math_score_on_real_answers(response, label, expected):
    assert math_score(response, label) == expected


def test_math_score_in_a_worker_thread_and_bad_labels():
    # math-verify's own timeouts need the main thread; judgers call from worker threads.
    out = []
    t = threading.Thread(
        target=lambda: out.append(
            (math_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), math_score("\\boxed{3}", "4"))
        )
    )
    t.start()
    t.join()
    assert out == [(1.0, 0.0)]
    for label in ("", "   ", "$$"):
        with pytest.raises(ValueError, match="cannot parse the label"):
            math_score("\\boxed{1}", label)


def test_built_in_rewards_resolve():
    assert [resolve(p).__name__ for p in BUILT_IN] == [
        "score",
        "score",
        "boxed",
        "ends_with_eos",
        "tool_format",
    ]


# ---- rlmega.rewards.format ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response,expected",
    [
        ("so \\boxed{42}.", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("no box", 0.0),
        ("\\boxed{1} or \\boxed{2}", 0.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{  }", 0.0),
        ("\\boxed{\\frac{1}{2}", 0.0),
        ("\\boxed{1", 0.0),
    ],
)
def test_boxed(response, expected):
    assert fmt.boxed(response, "anything") == expected


def test_ends_with_eos():
    assert fmt.ends_with_eos("46</s>", None) == 1.0 and fmt.ends_with_eos("46</s>\n", None) == 1.0
    assert (
        fmt.ends_with_eos("46", None) == 0.0
        and fmt.ends_with_eos("46<|im_end|>", None, eos="<|im_end|>") == 1.0
    )


@pytest.mark.parametrize(
    "response,expected",
    [
        ("no tools at all", 1.0),
        ("<tool>calculator:1+2</tool> then <tool>python:print(3)</tool>", 1.0),
        ("<tool> calculator : 1+2 </tool>", 1.0),
        ("<tool>calculator</tool>", 0.0),  # no ":args"
        ("<tool>calculator:</tool>", 0.0),  # blank args
        ("<tool>2calc:1</tool>", 0.0),  # not an identifier
        ("<tool>calculator:1+2", 0.0),  # unclosed
        ("calculator:1+2</tool>", 0.0),  # stray close
        ("<tool>a:<tool>b:1</tool></tool>", 0.0),  # nested
    ],
)
def test_tool_format(response, expected):
    assert fmt.tool_format(response, None) == expected


def test_tool_format_with_a_tool_list():
    assert fmt.tool_format("<tool>calculator:1+2</tool>", None, tools=["calculator"]) == 1.0
    assert fmt.tool_format("<tool>shell:rm -rf /</tool>", None, tools=["calculator"]) == 0.0


# ---- NativeJudger ---------------------------------------------------------------------------------
def test_native_sync_function_and_named_scores():
    j = NativeJudger("arith", "rlmega.rewards.arithmetic.score")
    assert run(j.judge(item("46</s>"))) == Judgement(scores={"arith": 1.0}, reward=1.0, error=None)
    assert run(j.judge(item("47"))).reward == 0.0
    named = NativeJudger("len", "rlmega.testing.judgers.length_scores")
    assert run(named.judge(item("46"))) == Judgement(
        scores={"len": 1.0, "len/length": 2.0}, reward=1.0
    )


def test_native_raising_and_hanging_judgers_score_0_with_a_flag_and_do_not_stop_others():
    j = NativeJudger("flaky", "rlmega.testing.rewards.flaky", kwargs={"hang_s": 5.0}, timeout_s=0.3)
    labels = ["ok", "raise", "hang", "ok", "text", "ok"]
    t = time.monotonic()
    out = run(j.judge_many([item("x", label=lab) for lab in labels]))
    took = time.monotonic() - t
    assert took < 2.0, took  # the hung call is abandoned at timeout_s, not waited for
    assert [o.reward for o in out] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert [o.error is None for o in out] == [True, False, False, True, False, True]
    assert (
        out[1].error
        == f"judger 'flaky' (native): ZeroDivisionError: label says raise (raised at {FLAKY_RAISES_AT})"
    )
    assert out[2].error == "judger 'flaky' (native): no result within timeout_s=0.3s"
    assert "TypeError" in out[4].error and "'not a number'" in out[4].error
    assert out[2].scores == {"flaky": 0.0}


def test_hung_calls_do_not_starve_later_items():
    # More hung calls than asyncio.to_thread's pool has threads (6 on 2 cores): later items still run.
    j = NativeJudger("flaky", "rlmega.testing.rewards.flaky", kwargs={"hang_s": 5.0}, timeout_s=0.2)

    async def scenario():
        hung = await j.judge_many([item("x", label="hang") for _ in range(12)])
        t = time.monotonic()
        good = await j.judge(item("x", label="ok"))
        return hung, good, time.monotonic() - t

    hung, good, took = run(scenario())
    assert all(h.error and "no result" in h.error for h in hung)
    assert good.reward == 1.0 and good.error is None and took < 0.2


def test_native_async_function():
    j = NativeJudger(
        "am", "rlmega.testing.judgers.async_match", kwargs={"delay_s": 0.05}, timeout_s=0.5
    )
    assert j.is_async
    out = run(j.judge_many([item("46"), item("45"), item("46", label="hang")]))
    assert [o.reward for o in out] == [1.0, 0.0, 0.0]
    assert out[2].error == "judger 'am' (native): no result within timeout_s=0.5s"


def test_native_bad_results_and_a_timeout_error_raised_by_the_function():
    j = NativeJudger("nr", "rlmega.testing.judgers.no_reward")
    assert "without a 'reward'" in run(j.judge(item("1"))).error

    def raises_timeout(response, label):
        raise TimeoutError("the sandbox timed out")

    def nan(response, label):
        return float("nan")

    # its own error, not the judger's timeout
    assert (
        run(NativeJudger("t", raises_timeout, timeout_s=5).judge(item("1"))).error
        == "judger 't' (native): TimeoutError: the sandbox timed out"
    )
    assert (
        run(NativeJudger("n", nan).judge(item("1"))).error
        == "judger 'n' (native): ValueError: the result is nan"
    )


def test_native_functions_that_ask_for_the_prompt_metadata_or_images_get_them():
    # A tool loop judges the answer after the last tool result; the transcript rides in metadata.
    j = NativeJudger("tools", "rlmega.rewards.format.tool_format", kwargs={"tools": ["calculator"]})
    good = item("42", metadata={"transcript": "<tool>calculator:40+2</tool><result>42</result>42"})
    bad = item("42", metadata={"transcript": "<tool>calculator</tool><result>error</result>42"})
    assert [v.reward for v in run(j.judge_many([good, bad, item("42")]))] == [1.0, 0.0, 1.0]
    assert j.wants == {"metadata"}

    def sees(response, label, prompt, metadata):
        return float(prompt == "q=" and metadata == {"turns": 2})

    assert run(NativeJudger("s", sees).judge(item("x", metadata={"turns": 2}))).reward == 1.0
    # **kwargs does not opt in
    assert NativeJudger("a", "rlmega.rewards.arithmetic.score").wants == set()

    # a vision-language prompt's images, the very objects the item holds
    def looks(response, label, images):
        return float(len(images) == 2 and images[0] is png)

    png = b"\x89PNG..."
    assert (
        run(NativeJudger("i", looks).judge(JudgeItem("q=", "x", images=(png, b"2")))).reward == 1.0
    )


def test_native_bad_path_fails_at_construction():
    with pytest.raises(
        ValueError, match=r"judger 'm' fn='rlmega.rewards.math.scroe'.*did you mean"
    ):
        NativeJudger("m", "rlmega.rewards.math.scroe")


# ---- CompositeJudger ------------------------------------------------------------------------------
class Fixed(Judger):
    """A judger with a fixed verdict (a custom subclass, also to test key prefixing)."""

    kind = "fixed"

    def __init__(self, name, value, weight):
        super().__init__(name, weight=weight)
        self.value = value

    async def _judge(self, item):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_composite_weights_scores_and_error_counts():
    judge = CompositeJudger(
        [
            NativeJudger(
                "digits", "rlmega.testing.rewards.digit_fraction", weight=2.0
            ),  # "12ab" -> 0.5
            NativeJudger(
                "len", "rlmega.testing.judgers.length_scores", weight=1.0
            ),  # != label -> 0, length 4
            Fixed("const", {"reward": 0.9, "digits": 7.0}, weight=0.5),
            Fixed("broken", RuntimeError("down"), weight=0.5),
        ]
    )
    j = run(judge.judge(item("12ab", label="x")))
    assert j.reward == pytest.approx((2.0 * 0.5 + 1.0 * 0.0 + 0.5 * 0.9 + 0.5 * 0.0) / 4.0)
    # "const"'s own "digits" never clashes with the judger "digits"
    assert j.scores == {
        "digits": 0.5,
        "len": 0.0,
        "len/length": 4.0,
        "const": 0.9,
        "const/digits": 7.0,
        "broken": 0.0,
    }
    # its `raise self.value`: user code
    raised_at = f"{__file__}:{Fixed._judge.__code__.co_firstlineno + 2}"
    assert j.error == f"judger 'broken' (fixed): RuntimeError: down (raised at {raised_at})"
    run(judge.judge_many([item("1", label="1"), item("2", label="2")]))
    assert judge.error_counts(reset=True) == {"digits": 0, "len": 0, "const": 0, "broken": 3}
    assert judge.error_counts() == {"digits": 0, "len": 0, "const": 0, "broken": 0}


def test_composite_prefixes_foreign_keys_and_rejects_bad_sets():
    class Raw(Judger):
        async def _judge(self, item):
            # a custom kind skipping the naming rule
            return Judgement(scores={"acc": 1.0}, reward=1.0)

    j = run(CompositeJudger([Raw("a"), Raw("b")]).judge(item("1")))
    assert j.scores == {"a/acc": 1.0, "b/acc": 1.0} and j.reward == 1.0 and j.error is None
    with pytest.raises(ValueError, match="distinct"):
        CompositeJudger([Raw("a"), Raw("a")])
    with pytest.raises(ValueError, match="sum to > 0"):
        CompositeJudger([Raw("a", weight=0.0)])


# ---- build_judger -----------------------------------------------------------------------------------
def test_build_judger_defaults_from_the_reward_section():
    reward = RewardConfig(fn="rlmega.testing.rewards.digit_fraction", num_workers=0, timeout_s=7.0)
    judge = build_judger([], reward)
    (only,) = judge.judgers
    assert isinstance(only, NativeJudger) and only.name == "reward" and only.timeout_s == 7.0
    assert only.fn_path == reward.fn
    assert run(judge.judge(item("12ab"))).scores == {"reward": 0.5}
    # fn "" means reward.fn; the list is checked before anything is built
    judge = build_judger(
        [
            JudgerConfig(name="r"),
            JudgerConfig(name="b", fn="rlmega.rewards.format.boxed", weight=3.0),
        ],
        reward,
    )
    assert [j.fn_path for j in judge.judgers] == [reward.fn, "rlmega.rewards.format.boxed"]
    assert run(judge.judge(item("\\boxed{1}"))).reward == pytest.approx((1 * 1 / 9 + 3 * 1.0) / 4)
    with pytest.raises(ConfigError, match=r"agent_loop\.judgers\[1\]\.url"):
        build_judger([JudgerConfig(name="a"), JudgerConfig(name="b", kind="http")], reward)
    with pytest.raises(ConfigError, match=r"reward\.fn: 'rlmega\.nope\.f'"):
        build_judger([], RewardConfig(fn="rlmega.nope.f", num_workers=0))


# ---- validate_judgers ---------------------------------------------------------------------------------
REWARD = RewardConfig()


def test_validate_accepts_good_lists(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    good = [
        JudgerConfig(name="math", fn="rlmega.rewards.math.score"),
        JudgerConfig(
            name="fmt", kind="ray", fn="rlmega.rewards.format.boxed", weight=0.1, num_actors=2
        ),
        JudgerConfig(name="svc", kind="http", url="http://127.0.0.1:9/score", weight=0.0),
        JudgerConfig(name="judge", kind="model", model_path=str(tmp_path)),
        JudgerConfig(name="dflt"),
    ]  # fn "" -> reward.fn
    assert validate_judgers(good, "agent_loop.judgers", REWARD) == []
    assert validate_judgers([], "agent_loop.judgers", REWARD) == []


@pytest.mark.parametrize(
    "bad,field,words",
    [
        (dict(kind="grpc"), "[0].kind", "unknown kind 'grpc'"),
        (dict(kind="http"), "[0].url", "needs a url"),
        (dict(kind="http", url="judge:8000"), "[0].url", "not an http(s) URL"),
        (dict(kind="model"), "[0].model_path", "needs a model_path"),
        (dict(kind="model", model_path="/nonexistent/judge"), "[0].model_path", "no config.json"),
        (
            dict(kind="model", model_path="MODEL", prompt_template="{question}"),
            "[0].prompt_template",
            "question",
        ),
        (dict(kind="model", model_path="MODEL", max_tokens=0), "[0].max_tokens", "not >= 1"),
        (dict(fn="rlmega.rewards.math.scroe"), "[0].fn", "did you mean"),
        (dict(kind="ray", fn="nope_pkg.f"), "[0].fn", "not found"),
        (dict(kind="ray", num_actors=0), "[0].num_actors", "not >= 1"),
        (dict(kind="ray", cpus_per_actor=-1), "[0].cpus_per_actor", "not >= 0"),
        (dict(timeout_s=0), "[0].timeout_s", "not > 0"),
        (dict(weight=-1.0), "[0].weight", "not a number >= 0"),
        (dict(weight=float("nan")), "[0].weight", "not a number >= 0"),
        (dict(name="a/b"), "[0].name", "not a usable name"),
    ],
)
def test_validate_rejects(tmp_path, bad, field, words):
    (tmp_path / "config.json").write_text("{}")
    if bad.get("model_path") == "MODEL":
        bad = {**bad, "model_path": str(tmp_path)}
    problems = validate_judgers(
        [JudgerConfig(**{"name": "j", **bad})], "tasks[2].agent_loop.judgers", REWARD
    )
    assert len(problems) == 1, problems
    assert (
        problems[0].startswith(f"tasks[2].agent_loop.judgers{field}: ") and words in problems[0]
    ), problems
    assert ". Fix: " in problems[0]


def test_validate_rejects_list_wide_problems():
    problems = validate_judgers(
        [
            JudgerConfig(name="a", weight=0.0),
            JudgerConfig(name="b", weight=0.0),
            JudgerConfig(name="a", weight=0.0),
        ],
        "agent_loop.judgers",
        REWARD,
    )
    assert problems[0].startswith(
        "agent_loop.judgers[2].name: duplicate name 'a' (also agent_loop.judgers[0])"
    )
    assert problems[1].startswith("agent_loop.judgers: the weights [0.0, 0.0, 0.0] sum to 0")
    assert len(problems) == 2
    empty_fn = validate_judgers(
        [JudgerConfig(name="a")], "agent_loop.judgers", RewardConfig(fn="rlmega.nope.f")
    )
    assert len(empty_fn) == 1 and "reward.fn='rlmega.nope.f' is used" in empty_fn[0]


# ---- the model judge's verdict rule ------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,reward",
    [
        ("0.75 because", 0.75),
        ("1", 1.0),
        ("  0", 0.0),
        (".5", 0.5),
        ("1.", 1.0),
        ("12", 0.0),
        ("-0.5", 0.0),
        ("Yes.", 1.0),
        ("y3", 1.0),
        ("yes", 1.0),
        ("yesterday", 0.0),
        ("no", 0.0),
        ("", 0.0),
        ("maybe 1", 0.0),
    ],
)
def test_parse_verdict(text, reward):
    assert parse_verdict(text) == reward
