"""AgentLoop: turn one prompt into a judged group of n trajectories through the engine router.

    loop = make_agent_loop(task="default", cfg=agent_loop_cfg, router=router, judger=judger,
                           tokenizer=tokenizer, sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=32))
    group = await loop.run_group(GroupRequest(prompt_index=0, prompt_ids=[...], label="46", seed=7), n=4)

Seeds: trajectory j of a group uses ``request.seed + j`` for its first turn (the driver gives group i
the seed ``step_seed + i * n``: exactly the per-sample seeds of the former batched generate, so the
single-turn loop samples the same tokens); turn t > 0 adds ``t * TURN_SEED_STRIDE``.

Single turn: one generation; the response is judged as decoded. Tool loop (kind "tool"): each model
turn stops at "</tool>" (or EOS / max tokens); a complete ``<tool>name:args</tool>`` runs the tool and
``<result>...</result>`` is tokenized once and appended with response_mask 0; the conversation is never
re-tokenized. It ends when a turn makes no call (reason: the turn's finish reason), after max_turns
turns still calling ("max_turns"), or at max_total_tokens response tokens ("max_tokens"). Judgers see
the text after the last tool result (the answer); the whole transcript is in metadata["transcript"].
A tool that answers with an image (zoom, for a vision-language model) adds an image observation: the
engine's next turn gets the image too, and the trajectory its own vision inputs
(rlmega/agents/image_observations.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

from rlmega.agents.image_observations import Observations
from rlmega.agents.router import EngineRouter, GenerationFailed
from rlmega.agents.tool_protocol import CALL_CLOSE, RESULT_CLOSE, format_result, parse_call
from rlmega.agents.tools import ImageResult, run_call
from rlmega.agents.trajectory import Trajectory, TrajectoryGroup
from rlmega.config.agent_rules import IMAGE_TOOLS
from rlmega.data.images import processor_vision
from rlmega.judgers.base import JudgeItem

# far from the per-sample seed steps, so turns of nearby samples never share a seed
TURN_SEED_STRIDE = 7_919_993


@dataclasses.dataclass
class GroupRequest:
    """One prompt to turn into a group: its position in the step (group id), tokens, label, seed."""

    prompt_index: int
    prompt_ids: list[int]
    label: Any
    seed: int | None
    prompt_text: str = ""
    n: int | None = None
    """Trajectories in the group; None: the loop's default (rollout.n)."""
    sampling: dict | None = None
    """Overrides of the loop's sampling (evaluation: temperature 0, n 1)."""
    images: tuple = ()
    """A vision-language prompt's images (encoded files); ``prompt_ids`` then hold one placeholder per image."""
    scored_ids: list[int] | None = None
    """With images: the prompt as the processor expands it (what the trainer scores, and what the engine's
    expansion must equal)."""
    columns: dict = dataclasses.field(default_factory=dict)
    """The prompt row's other columns, for the judgers."""


class AgentLoop:
    """Base: runs ``_trajectory`` n times concurrently, judges each, and groups them."""

    def __init__(
        self,
        task: str,
        cfg,
        router: EngineRouter,
        judger,
        tokenizer,
        sampling: dict,
        n: int,
        processor=None,
    ):
        self.task, self.cfg, self.router, self.judger, self.tokenizer = (
            task,
            cfg,
            router,
            judger,
            tokenizer,
        )
        self.sampling, self.n = dict(sampling), n
        # a vision-language model's (rlmega.data.images.load_processor), else None
        self.processor = processor

    async def run_group(self, req: GroupRequest) -> TrajectoryGroup:
        group = TrajectoryGroup(task=self.task, prompt_index=req.prompt_index, label=req.label)
        if req.images:  # the prompt's image tensors, once for its n trajectories (they share them)
            group.vision, expanded = processor_vision(self.processor, req.prompt_text, req.images)
            if expanded != req.scored_ids:
                raise ValueError(
                    f"prompt {req.prompt_index}: the processor expands its images otherwise now than "
                    "when the data was loaded"
                )
        sampling = {**self.sampling, **(req.sampling or {})}
        if req.images:
            sampling["images"] = list(req.images)
        n = req.n or self.n
        # let every try finish
        trajs = await asyncio.gather(
            *[
                self._trajectory(req, sampling, None if req.seed is None else req.seed + j)
                for j in range(n)
            ],
            return_exceptions=True,
        )
        failed = [t for t in trajs if isinstance(t, BaseException)]
        if failed:  # never a zero-reward row: the whole group goes
            if not all(isinstance(e, GenerationFailed) for e in failed):
                raise next(e for e in failed if not isinstance(e, GenerationFailed))
            group.error = str(failed[0])
            return group
        judgements = await asyncio.gather(*[self.judger.judge(self._item(req, t)) for t in trajs])
        for t, j in zip(trajs, judgements):
            t.scores, t.reward, t.judge_error = dict(j.scores), float(j.reward), j.error
        group.trajectories = list(trajs)
        return group

    def _item(self, req: GroupRequest, t: Trajectory) -> JudgeItem:
        return JudgeItem(
            prompt_text=req.prompt_text,
            response_text=t.response_text,
            label=req.label,
            response_raw=t.response_raw,
            columns=req.columns,
            prompt_ids=list(t.prompt_ids),
            response_ids=list(t.response_ids),
            metadata={"task": self.task, "finish_reason": t.finish_reason, **t.metadata},
            images=req.images,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _without_special_tokens(self, text: str) -> str:
        """``text`` less the tokenizer's special tokens' strings ("</s>", "<|im_end|>"): what a decode with
        skip_special_tokens=True gives, for text cut from a decoded transcript."""
        for special in sorted(self.tokenizer.all_special_tokens, key=len, reverse=True):
            text = text.replace(special, "")
        return text

    async def _trajectory(self, req: GroupRequest, sampling: dict, seed: int | None) -> Trajectory:
        raise NotImplementedError


class SingleTurnAgentLoop(AgentLoop):
    async def _trajectory(self, req, sampling, seed):
        s = await self.router.generate(req.prompt_ids, {**sampling, "seed": seed})
        t = Trajectory(prompt_ids=scored_prompt(req, s), finish_reason=s.finish_reason, num_turns=1)
        t.append(s.response_ids, s.logprobs, s.token_versions, model=True, routes=s.routed_experts)
        # what TRL and verl score: the completion decoded without special tokens; the raw text beside it
        t.response_raw = self._decode(t.response_ids)
        t.response_text = self.tokenizer.decode(t.response_ids, skip_special_tokens=True)
        return t


class ToolAgentLoop(AgentLoop):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a template whose image placeholder cannot be read fails here,
        if set(self.cfg.tools) & set(IMAGE_TOOLS):
            self.observations  # noqa: B018 -- when the loop is built, not at the first image answer mid-run

    async def _trajectory(self, req, sampling, seed):
        cfg = self.cfg
        budget = cfg.max_total_tokens or sampling["max_tokens"]
        # (checked against the engine's below)
        t = Trajectory(prompt_ids=list(req.scored_ids or req.prompt_ids))
        context = list(req.prompt_ids)
        # the engine's images; image observations, their spans
        images, observed, spans = list(req.images), [], []
        for turn in range(cfg.max_turns):
            left = budget - len(t.response_ids)
            if left <= 0:
                t.finish_reason = "max_tokens"
                break
            turn_seed = None if seed is None else (seed + turn * TURN_SEED_STRIDE) % 2**31
            s = await self.router.generate(
                context,
                {
                    **sampling,
                    "max_tokens": left,
                    "seed": turn_seed,
                    "stop": [CALL_CLOSE],
                    **({"images": images} if images else {}),
                },
            )
            if turn == 0:
                scored_prompt(req, s)
            elif images and list(s.prompt_ids) != t.prompt_ids + t.response_ids:
                raise ValueError(
                    f"prompt {req.prompt_index}, turn {turn}: the engine expanded the images of the "
                    "context otherwise than the trajectory holds them (check the processor files)"
                )
            t.append(
                s.response_ids, s.logprobs, s.token_versions, model=True, routes=s.routed_experts
            )
            context += s.response_ids
            t.num_turns += 1
            text = self._decode(s.response_ids)
            call = (
                parse_call(text)
                if s.finish_reason == "stop" and text.rstrip().endswith(CALL_CLOSE)
                else None
            )
            if call is None:  # an answer (or a turn cut at max tokens): the trajectory is done
                t.finish_reason = (
                    "max_tokens"
                    if s.finish_reason == "length" and left < sampling["max_tokens"]
                    else s.finish_reason
                )
                break
            output = await self._run_tool(call, req.images)
            t.tool_calls += 1
            if isinstance(output, ImageResult) and self.observations.follows_a_sampled_placeholder(
                t.response_ids, t.response_mask
            ):
                output = "error: no image after an image token the model wrote"
            if isinstance(output, ImageResult):
                engine_ids, ids, (a, b) = self.observations.tokens(output.png)
                # an image is never cut: it fits or is refused
                if len(t.response_ids) + len(ids) <= budget:
                    spans.append((len(t.response_ids) + a, len(t.response_ids) + b))
                    observed.append(output.png)
                    images.append(output.png)
                    t.append(ids, None, -1, model=False)
                    context += engine_ids
                    continue
                output = "error: no room left for the image"
            t.tool_errors += output.startswith("error")
            # tokenized once; tool output is text, never a special token (an image placeholder, an end of turn)
            ids = self.tokenizer(
                format_result(output), add_special_tokens=False, split_special_tokens=True
            )["input_ids"]
            # the result does not fit: keep what does, stop
            if len(t.response_ids) + len(ids) > budget:
                ids = ids[: budget - len(t.response_ids)]
                t.append(ids, None, -1, model=False)
                t.finish_reason = "max_tokens"
                break
            t.append(ids, None, -1, model=False)
            context += ids
        else:
            t.finish_reason = "max_turns"
        # the trainer's images: the prompt's, then the observations' (spans say where they sit)
        if observed:
            t.vision = self.observations.trajectory_vision(
                req.prompt_text,
                req.images,
                observed,
                spans,
                scored=t.prompt_ids + [i for a, b in spans for i in t.response_ids[a:b]],
            )
        transcript = self._decode(t.response_ids)
        t.metadata = {
            "transcript": transcript,
            "tool_calls": t.tool_calls,
            **({"image_observations": len(observed)} if observed else {}),
        }
        # the answer after the last tool result
        t.response_raw = transcript.rsplit(RESULT_CLOSE, 1)[-1]
        t.response_text = self._without_special_tokens(t.response_raw)
        return t

    @functools.cached_property
    def observations(self) -> Observations:
        return Observations(self.processor)

    async def _run_tool(self, call, images=()):
        # Tools block (the Python evaluator waits on its process): off the event loop.
        return await asyncio.to_thread(
            run_call, call, self.cfg.tools, self.cfg.tool_timeout_s, self.cfg.tool_memory_mb, images
        )


def scored_prompt(req: GroupRequest, s) -> list[int]:
    """The prompt the trainer scores: the request's ids, or an image prompt's as the engine expanded them, which
    must be the processor's expansion (the trainer's image features go to the processor's placeholders)."""
    if not req.images:
        return list(req.prompt_ids)
    if list(s.prompt_ids) != list(req.scored_ids):
        raise ValueError(
            f"prompt {req.prompt_index}: the engine expanded its {len(req.images)} image(s) into "
            f"{len(s.prompt_ids)} prompt tokens, the model's processor into {len(req.scored_ids)}: the "
            "engine and the processor disagree on the image tokens (check the processor files in "
            "model.path)"
        )
    return list(s.prompt_ids)


LOOPS = {"single_turn": SingleTurnAgentLoop, "tool": ToolAgentLoop}


def make_agent_loop(
    task: str, cfg, router, judger, tokenizer, sampling: dict, n: int, processor=None
) -> AgentLoop:
    return LOOPS[cfg.kind](task, cfg, router, judger, tokenizer, sampling, n, processor)
