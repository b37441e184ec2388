"""The agent side's pure parts: the task split, trajectories -> the trainer's batch (tool tokens masked),
the rollout metrics, warm-start targets in the tool format, and Tasks' resumable positions."""

import math

import pytest

from rlmega.agents.metrics import rollout_metrics
from rlmega.agents.sft import sft_example
from rlmega.agents.tasks import Tasks, split_by_weight
from rlmega.config.resolved import task_configs
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup, batch_from_groups
from rlmega.config.schema import AgentLoopConfig, RLConfig, TaskConfig
from rlmega.demo.tiny_model import make_tokenizer


def test_split_by_weight_is_largest_remainder_and_sums_to_the_total():
    assert split_by_weight(4, [1, 1]) == [2, 2]
    # exact 3.33 / 1.67: the larger remainder takes the last one
    assert split_by_weight(5, [2, 1]) == [3, 2]
    assert split_by_weight(7, [1, 1, 1]) == [3, 2, 2]  # ties go to the earlier task
    assert split_by_weight(3, [1, 0]) == [3, 0]
    for total in range(0, 20):
        assert sum(split_by_weight(total, [0.3, 1.7, 2.0])) == total


def _traj(model_ids, tool_ids, reward, reason="stop", scores=None, error=None):
    t = Trajectory(
        prompt_ids=[1, 2, 3],
        finish_reason=reason,
        num_turns=2 if tool_ids else 1,
        tool_calls=1 if tool_ids else 0,
        scores=scores or {"correct": reward},
        reward=reward,
        judge_error=error,
    )
    t.append(model_ids, [-0.5] * len(model_ids), 3, model=True)
    if tool_ids:
        t.append(tool_ids, None, -1, model=False)
        t.append([9], [-0.1], 3, model=True)
    return t


def test_batch_from_groups_masks_tool_tokens_and_drops_failed_groups():
    ok = TrajectoryGroup("calc", 0, "46", [_traj([5, 6], [7, 7, 7], 1.0), _traj([5], [], 0.0)])
    failed = TrajectoryGroup("calc", 1, "3", error="generation failed 3 times")
    other = TrajectoryGroup("plain", 2, "9", [_traj([4, 4], [], 0.5)])
    batch = batch_from_groups([ok, failed, other])
    assert len(batch) == 3 and batch.group_ids.tolist() == [0, 0, 2]
    # the tool result [7, 7, 7] is out of the loss
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1]
    assert batch.rollout_logprobs[0].tolist() == [-0.5, -0.5, 0, 0, 0, pytest.approx(-0.1)]
    assert batch.tokens[0].tolist() == [1, 2, 3, 5, 6, 7, 7, 7, 9]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert ok.trajectories[0].versions == [3, 3, -1, -1, -1, 3]


def test_rollout_metrics_per_task_scores_finish_reasons_and_drops():
    groups = [
        TrajectoryGroup(
            "calc", 0, "1", [_traj([5, 6], [7, 7], 1.0), _traj([5], [], 0.0, "length", error="x")]
        ),
        TrajectoryGroup("calc", 1, "1", error="lost"),
        TrajectoryGroup("plain", 2, "1", [_traj([4], [], 0.5, "stop")]),
    ]
    m = rollout_metrics(groups, ["calc", "plain", "unused"])
    assert m["groups_dropped"] == 1 and m["judge_errors"] == 1
    assert m["task/calc/reward_mean"] == 0.5 and m["task/plain/reward_mean"] == 0.5
    assert m["task/calc/response_length"] == (5 + 1) / 2
    assert math.isnan(m["task/unused/reward_mean"])
    assert m["score/correct"] == pytest.approx(1.5 / 3)
    assert m["finish/stop"] == pytest.approx(2 / 3) and m["finish/length"] == pytest.approx(1 / 3)
    assert m["tool_calls_mean"] == pytest.approx(1 / 3)


def test_tool_warm_start_target_masks_the_result_the_model_never_writes():
    tok = make_tokenizer()
    loop = AgentLoopConfig(kind="tool", tools=["calculator"])
    ids, mask = sft_example(tok.encode("12+34="), "12+34=", "46", loop, tok)
    text = tok.decode(ids)
    assert text == "<tool>calculator:12+34</tool><result>46</result>46</s>"
    masked = tok.decode([i for i, m in zip(ids, mask) if m == 0])
    assert masked == "<result>46</result>"
    single, smask = sft_example(tok.encode("12+34="), "12+34=", "46", AgentLoopConfig(), tok)
    assert tok.decode(single) == "46</s>" and smask == [1.0] * 3


def test_warm_start_targets_cut_to_max_tokens_lose_their_eos():
    from rlmega.data.prompts import Prompt
    from rlmega.step import sft_batch

    tok = make_tokenizer()
    picked = [
        ("t", Prompt(0, tok.encode("c7:"), "7036925814", "c7:")),
        ("t", Prompt(1, tok.encode("a1:"), "12", "a1:")),
    ]
    loops = {"t": AgentLoopConfig()}
    whole, cut = sft_batch(picked, tok, loops), sft_batch(picked, tok, loops, max_tokens=4)
    assert [tok.decode(t[3:]) for t in whole.tokens] == ["7036925814</s>", "12</s>"]
    # a target that fits keeps its EOS
    assert [tok.decode(t[3:]) for t in cut.tokens] == ["7036", "12</s>"]
    assert [m.tolist() for m in cut.response_mask] == [[1.0] * 4, [1.0] * 3]


def _tasks(cfg, tok):
    return Tasks(
        task_configs(cfg),
        tok,
        prompts_per_step=cfg.trainer.prompts_per_step,
        model_path=cfg.model.path,
        rollout=cfg.rollout,
    )


def test_tasks_mix_by_weight_and_resume_their_positions():
    tok = make_tokenizer()
    cfg = RLConfig()
    cfg.trainer.prompts_per_step = 6
    cfg.tasks = [TaskConfig(name="a", weight=2.0), TaskConfig(name="b", weight=1.0)]
    cfg.tasks[1].data.seed = 7
    tasks = _tasks(cfg, tok)
    assert tasks.counts == [4, 2]
    first = tasks.next_prompts()
    assert [name for name, _ in first] == ["a"] * 4 + ["b"] * 2
    state = tasks.state_dict()
    later = [tasks.next_prompts() for _ in range(3)]
    again = _tasks(cfg, tok)
    again.load_state_dict(state)
    assert [[(n, p.index) for n, p in x] for x in later] == [
        [(n, p.index) for n, p in again.next_prompts()] for _ in range(3)
    ]
    with pytest.raises(ValueError, match="task"):
        _tasks(cfg, tok).load_state_dict({"tasks": {"a": state["tasks"]["a"]}})


def test_a_single_default_task_keeps_the_checkpoint_layout_of_before():
    tok = make_tokenizer()
    tasks = _tasks(RLConfig(), tok)
    assert tasks.names == ["default"] and "sampler" in tasks.state_dict()


def test_on_error_fail_ends_the_run_naming_task_prompt_label_and_fix():
    from rlmega.judgers.base import RewardError
    from rlmega.step import check_judgements

    bad = TrajectoryGroup(
        "calc",
        3,
        "46",
        [_traj([5], [], 0.0), _traj([5], [], 0.0, error="judger 'c': ZeroDivisionError")],
    )
    check_judgements([bad], "zero")  # counted, not raised
    with pytest.raises(RewardError) as e:
        check_judgements([bad], "fail")
    msg = str(e.value)
    assert (
        "task 'calc'" in msg and "prompt 3" in msg and "'46'" in msg and "ZeroDivisionError" in msg
    )
    assert "reward.on_error=zero" in msg


def test_a_batch_whose_every_reward_failed_ends_the_run_whatever_on_error_says():
    """Issue 56: a reward that raised on every trajectory trained on zeros, then printed "done" and exited 0."""
    from rlmega.judgers.base import RewardError
    from rlmega.step import check_judgements

    error = "judger 'reward' (native): KeyError: 'answer' (raised at /home/me/my_reward.py:7)"
    # no trajectory: not judged
    dropped = TrajectoryGroup("calc", 0, "1", [], error="the engine failed")
    all_bad = [
        dropped,
        *[TrajectoryGroup("calc", i, "46", [_traj([5], [], 0.0, error=error)] * 2) for i in (1, 2)],
    ]
    for on_error in ("zero", "fail"):
        with pytest.raises(
            RewardError, match="KeyError: 'answer' \\(raised at /home/me/my_reward.py:7\\)"
        ):
            check_judgements(all_bad, on_error)
    with pytest.raises(
        RewardError, match="the reward failed on every one of the batch's 4 trajectories"
    ):
        check_judgements(all_bad, "zero")
    # one scored
    check_judgements(all_bad + [TrajectoryGroup("calc", 3, "46", [_traj([5], [], 1.0)])], "zero")


def test_the_engine_class_has_no_coroutine_methods_so_ray_hosts_it_as_a_threaded_actor():
    """Ray makes a class with any ``async def`` method an asyncio actor, whose sync methods run one at a
    time: concurrent generate_one requests were then served serially (25.3 s instead of 1.5 s for 64)."""
    import inspect

    from rlmega.rollout.rollout import RolloutWorker

    assert not [n for n, m in inspect.getmembers(RolloutWorker) if inspect.iscoroutinefunction(m)]
