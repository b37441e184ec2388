"""Generation requests: the gate a weight sync closes, and partial rollouts that go on after it.

The functions take the RolloutWorker as ``self`` and run on its event loop (rlmega/rollout/rollout.py);
they live outside the class because Ray makes any actor class with an ``async def`` method an asyncio
actor, whose methods then run one at a time. What a request is, how a pause cuts and resumes it, how
stop strings across a cut end it, and which log-probs vLLM returns: docs/rollout_engine.md.

A request is one ``_Request`` in ``self._live``; the gate, ``_live`` and the busy clock are touched on
the loop thread only, and a request checks the gate and marks its part running with no ``await`` in
between, so a pause sees every request either running (and counts it) or waiting at the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import warnings

import numpy as np

from rlmega.data.images import decode_images
from rlmega.rollout.engine_routes import fit_rows


@dataclasses.dataclass
class Sample:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the list given to ``generate`` (0 from ``generate_one``)."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """One per response token: log_softmax(logits / temperature)[sampled token] (docs/rollout_engine.md: Log-probs)."""
    finish_reason: str
    """``"stop"`` (EOS, a stop token or a stop string, kept as the end of the response), ``"length"``
    (max_tokens), ``"abort"`` (``abort``: the tokens sampled until then), or whatever else vLLM reports."""
    weight_version: int = 0
    """The engine's weight version (``update_weights``) when the request started."""
    token_versions: list[int] = dataclasses.field(default_factory=list)
    """One per response token: the weight version it was sampled with. All ``weight_version``
    unless a weight sync cut the request and it resumed (``RolloutWorker.pause_generation``)."""
    resumes: int = 0
    """How many times a weight sync cut this request and it went on with the new weights."""
    routed_experts: np.ndarray | None = None
    """MoE routing replay (``record_routes=True``): int16 (len(prompt_ids) + len(response_ids),
    num_moe_layers, topk), row j = the experts (model-global ids; MoE layers in model order) the
    engine's routers picked for token j of prompt + response. -1 rows where no route was recorded:
    the last response token (vLLM samples it but never feeds it back: no forward computes it),
    and prompt tokens a prefix-cache hit skipped (``enable_prefix_caching``). After a cut and resume
    each position keeps the route of its latest computation (the resumed part re-prefills prompt +
    tokens so far on the new weights: the final KV came from those routes). None when not recorded."""


class _Request:
    """One ``generate``/``generate_one`` request while the worker holds it (loop thread only)."""

    def __init__(self):
        # the engine request now or last running; set once ended
        self.part: asyncio.Event | None = None
        # that engine request's id: the caller's id + "#<n>", unique
        self.engine_id: str | None = None
        self.preempted = False  # pause_generation(abort_in_flight=True) aborted that engine request
        # ... and this request goes on after the pause (known when ``part`` is set)
        self.cut = False
        self.aborted = asyncio.Event()  # abort(): end with what it has, never resume
        self.done = asyncio.Event()  # returned to its caller


async def generate_request(
    self,
    prompt_ids: list[int],
    params,
    request_id: str,
    prompt_index: int,
    images: list[bytes] | None = None,
) -> Sample:
    """``images``: a vision-language prompt's images (encoded files); ``prompt_ids`` then hold one placeholder per
    image, and the Sample's ``prompt_ids`` are the engine's expanded ones (what the trainer scores)."""
    from vllm.inputs import TokensPrompt

    mm = {"multi_modal_data": {"image": decode_images(images)}} if images else {}
    # the expanded prompt, from the engine's first part
    scored_prompt = None if images else prompt_ids
    req = _Request()
    self._live.setdefault(request_id, []).append(req)
    ids, logprobs, versions, cuts = [], [], [], []  # cuts: len(ids) at each cut
    reason, first_version, resumes, part_params = "abort", None, 0, params
    routes = None if self._routes is None else self._routes.empty()
    try:
        # One engine request per part: a pause with abort_in_flight cuts the part running, and the
        # next continues from prompt + tokens so far (docs/rollout_engine.md: In-flight weight syncs). From the
        # gate check to req.part there is no await, so a pause sees this request running or waiting.
        while await wait_for_gate(self, req):  # False: abort() ended it while it waited
            if req.cut:
                resumes += 1
                part_params = continuation(params, len(ids), resumes)
            version = self._version
            first_version = version if first_version is None else first_version
            req.part, req.preempted, req.cut = asyncio.Event(), False, False
            # Each engine request gets an id of its own (abort and the routes address that part alone;
            # callers may share a request id).
            req.engine_id = f"{request_id}#{next(self._ids)}"
            count_running(self, +1)
            try:
                final = None
                try:
                    async for out in self._engine.generate(
                        TokensPrompt(prompt_token_ids=prompt_ids + ids, **mm),
                        part_params,
                        req.engine_id,
                        lora_request=self._lora,
                    ):
                        final = out  # FINAL_ONLY: the one output, when the part has ended
                    # the images' tokens, expanded by the engine
                    if scored_prompt is None and final is not None:
                        scored_prompt = list(final.prompt_token_ids)[
                            : len(final.prompt_token_ids) - len(ids)
                        ]
                finally:
                    if routes is not None:  # taken even from a failed part: the engine frees them
                        # positions it surely computed: its last input token and each sampled token but the last
                        # (the engine's prompt: an image prompt's placeholders expanded)
                        p0 = (
                            len(prompt_ids) + len(ids)
                            if final is None
                            else len(final.prompt_token_ids)
                        )
                        n = 0 if final is None else len(final.outputs[0].token_ids)
                        routes = await self._routes.take(
                            self._engine,
                            req.engine_id,
                            routes,
                            must_have=range(p0 - 1, p0 + n - 1) if n else range(0),
                        )
                c = final.outputs[0]
                new = list(c.token_ids)
                ids += new
                # logprobs=0: one {token_id: Logprob} per position, holding the sampled token.
                logprobs += [step[t].logprob for t, step in zip(new, c.logprobs or [])]
                versions += [version] * len(new)
                reason = str(c.finish_reason)
                # Aborted by a pause, not by abort(), nor ended on its own as the abort came: go on,
                # unless no token is left to sample (max_tokens, or the model's length: vLLM's own cap).
                if reason == "abort" and req.preempted and not req.aborted.is_set():
                    if (
                        len(ids) >= params.max_tokens
                        or len(prompt_ids) + len(ids) >= self.max_model_len
                    ):
                        reason = "length"
                    else:
                        req.cut = True
                # a stop string across an earlier cut ends the response there
                if cuts and params.stop:
                    end = stop_across_cuts(
                        self._engine.tokenizer, ids, cuts, params.stop, params.skip_special_tokens
                    )
                    if end is not None:
                        del ids[end:], logprobs[end:], versions[end:]
                        # (routes: cut to prompt + response below)
                        reason, req.cut = "stop", False
                if req.cut:
                    cuts.append(len(ids))
            finally:
                count_running(self, -1)
                req.part.set()  # pause_generation reads req.cut once this is set
            if not req.cut:
                break
    finally:
        live = self._live[request_id]
        live.remove(req)
        if not live:
            del self._live[request_id]
        req.done.set()
    # no part ran (aborted at the gate): nothing was expanded, nothing to score
    if scored_prompt is None:
        scored_prompt = prompt_ids
    return Sample(
        prompt_index=prompt_index,
        prompt_ids=scored_prompt,
        response_ids=ids,
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=self._version if first_version is None else first_version,
        token_versions=versions,
        resumes=resumes,
        routed_experts=None if routes is None else fit_rows(routes, len(scored_prompt) + len(ids)),
    )


async def wait_for_gate(self, req: _Request) -> bool:
    """Until the gate is open and no weight stream is loading (at once if so: no await); False if
    abort() ended ``req`` meanwhile. (A request sent while weights load would run on the new weights
    but read the old version; the engine would hold it until the load ends anyway.)"""
    gates = (self._gate, self._weights.loaded)
    while not all(g.is_set() for g in gates) and not req.aborted.is_set():
        waits = [asyncio.ensure_future(g.wait()) for g in gates if not g.is_set()]
        waits.append(asyncio.ensure_future(req.aborted.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return not req.aborted.is_set()


def stop_across_cuts(
    tokenizer, ids: list[int], cuts: list[int], stop: list[str], skip_special_tokens: bool
) -> int | None:
    """Length of ``ids`` up to the token that first completes a stop string spanning one of ``cuts``
    (positions in ``ids`` where a request was cut and resumed), or None.

    Each engine request's own stop strings vLLM has matched; one spanning a cut ends within the
    longest stop string's length after it, so the text is decoded token by token from the cut until
    that many characters past it, and checked as vLLM's detokenizer checks each new token's text
    (``check_stop_strings``, include_stop_str_in_output as ``_params`` asks). A match found there
    wholly after the cut is one vLLM ended that part on: the same end.
    """
    from vllm.v1.engine.detokenizer import check_stop_strings

    longest, first = max(map(len, stop)), None
    for cut in cuts:
        before = prev = tokenizer.decode(ids[:cut], skip_special_tokens=skip_special_tokens)
        for end in range(cut + 1, len(ids) + 1 if first is None else min(first, len(ids) + 1)):
            text = tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
            if check_stop_strings(text, len(text) - len(prev), stop, True) is not None:
                first = end
                break
            if len(text) - len(before) >= longest:  # any later match lies wholly after the cut
                break
            prev = text
    return first


def continuation(params, sampled: int, resumes: int):
    """SamplingParams of a cut request's next part: the tokens left, and another seed if seeded."""
    params = params.clone()
    params.max_tokens -= sampled
    if params.seed is not None:
        # vLLM gives a seeded request its own generator: with the same seed the continuation would draw
        # the very random numbers the first part drew for its first tokens, samples correlated with
        # that part's instead of fresh ones. A large prime step keeps the new seed away from those of
        # the neighbouring requests (generate seeds them seed + i * n + j).
        params.seed = (params.seed + resumes * _RESUME_SEED_STEP) % 2**31
    return params


_RESUME_SEED_STEP = 1_000_000_007  # a prime


async def pause(self, abort_in_flight: bool) -> int:
    self._gate.clear()  # from here no engine request starts: new and cut requests wait at the gate
    running = [
        (req.engine_id, req, req.part)
        for reqs in self._live.values()
        for req in reqs
        if req.part is not None and not req.part.is_set()
    ]
    if not abort_in_flight:
        await asyncio.gather(*[part.wait() for _, _, part in running])
        return len(running)
    for _, req, _ in running:
        req.preempted = True
    # As in _abort: an engine request still being registered misses an abort, so abort again.
    while not all(part.is_set() for _, _, part in running):
        await self._engine.abort(list({rid for rid, _, part in running if not part.is_set()}))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*[part.wait() for _, _, part in running]), timeout=0.05
            )
    return sum(req.cut for _, req, _ in running)


async def abort(self, request_id: str) -> bool:
    ending = list(self._live.get(request_id, []))
    if not ending:
        return False
    for req in ending:
        req.aborted.set()  # never resumed; one waiting at the gate returns at once
    # A request still being registered by AsyncLLM.generate (an await before the engine knows
    # it) misses an abort, so abort again until each has ended.
    while not all(req.done.is_set() for req in ending):
        await self._engine.abort([req.engine_id for req in ending if req.engine_id is not None])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*[req.done.wait() for req in ending]), timeout=0.05
            )
    return True


def sampling_params(temperature, top_p, top_k, max_tokens, stop_token_ids, stop, seed, ignore_eos):
    """SamplingParams for one response (n=1) whose log-probs are the sampled tokens' own."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else 0,
        max_tokens=max_tokens,
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        # Token ids in and out; stop strings are matched on text, so only then detokenize.
        stop=list(stop or []),
        detokenize=bool(stop),
        include_stop_str_in_output=bool(stop),
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, as LLM.generate asks
    )


def warn_truncation(top_p: float, top_k: int) -> None:
    if top_p < 1.0 or top_k > 0:
        warnings.warn(
            f"top_p={top_p}, top_k={top_k}: vLLM's processed log-probs are renormalised over the "
            "kept tokens, so they are not the trainer's full-vocabulary log_softmax(logits / T)",
            stacklevel=3,
        )


def count_running(self, delta: int) -> None:
    """One engine request more (+1) or less (-1) running; opens and closes busy intervals (loop only)."""
    if self._running == 0 and delta > 0:
        self._busy_since = time.monotonic()
    self._running += delta
    if self._running == 0:
        self._busy_closed += time.monotonic() - self._busy_since
