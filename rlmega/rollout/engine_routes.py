"""The routes a RolloutWorker's engine recorded, per engine request, laid onto each Sample (MoE, R3).

RolloutWorker (rlmega/rollout/rollout.py) side of route capture; the engine side, which records them
inside vLLM's worker, is ``rlmega_record_routes`` / ``rlmega_take_routes`` in
rlmega/rollout/vllm_extension.py and its store, rlmega/rollout/route_store.py.

    routes = await start_recording(engine)          # EngineRoutes: (num_moe_layers, topk) per row
    rows = routes.empty()                           # (0, layers, topk) int16
    rows = await routes.take(engine, engine_id, rows, must_have=range(p0 - 1, p0 + n - 1))  # a part ended
    sample_rows = fit_rows(rows, len(prompt) + len(response))

Rows are int16 (positions, num_moe_layers, topk), row j = position j of prompt + response, -1 where
no route was recorded (``Sample.routed_experts``).

Missing routes are counted, not silent: a part that sampled tokens computed the position before its
first sampled token and every sampled token but the last, so those rows must be there. When some are
not (CUDA-graph replay skips the routers' capture hook, or vLLM changed how it suffixes request ids,
which the engine's store matches), the first such part logs a warning, and ``missing_parts`` /
``missing_rows`` count them all; the rows go to the trainer as -1 (routed live, in
routes_live_fraction).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


class EngineRoutes:
    """What one engine records: its MoE layout, and the taking of each engine request's rows."""

    def __init__(self, num_layers: int, topk: int, num_experts: int):
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        self.missing_parts = 0  # engine requests that lacked rows they must have (module doc)
        self.missing_rows = 0  # ... and how many rows, all together

    @property
    def shape(self) -> tuple[int, int]:
        """(num_moe_layers, topk) of each row."""
        return self.num_layers, self.topk

    def empty(self) -> np.ndarray:
        return np.full((0, self.num_layers, self.topk), -1, dtype=np.int16)

    async def take(
        self, engine, engine_id: str, routes: np.ndarray, must_have: range = range(0)
    ) -> np.ndarray:
        """``routes`` with the rows the engine recorded for one engine request (a part) laid over it.

        A part computes prompt + tokens so far (a resumed part re-prefills them on the new weights) and
        each token it samples but the last; its rows replace the older ones wherever it computed a
        position: a position keeps the routes of its latest computation, the one its final KV came from
        (a prefix-cache hit computes nothing and keeps the older row). ``must_have``: positions the part
        surely computed (for a part that sampled n tokens from p0 input tokens: p0 - 1 .. p0 + n - 2);
        rows missing there are counted and warned about (module doc).
        """
        try:
            answers = await engine.collective_rpc("rlmega_take_routes", args=([engine_id],))
        except Exception as exc:  # the engine is gone: the part's own error is the one to report
            logger.warning("routes of %s not taken: %r", engine_id, exc)
            return routes
        got = next(a for a in answers if a is not None).get(engine_id)
        # nothing computed (aborted while queued)
        part = np.full((0, *self.shape), -1, dtype=np.int16)
        if got is not None:
            data, shape = got
            part = np.frombuffer(data, dtype=np.int16).reshape(shape)
        self._check(engine_id, part, must_have)
        if not len(part):
            return routes
        routes = fit_rows(routes, max(len(routes), len(part)))
        computed = part[:, 0, 0] != -1
        routes[: len(part)][computed] = part[computed]
        return routes

    def _check(self, engine_id: str, part: np.ndarray, must_have: range) -> None:
        missing = sum(1 for j in must_have if j >= len(part) or part[j, 0, 0] == -1)
        if not missing:
            return
        self.missing_parts += 1
        self.missing_rows += missing
        if self.missing_parts == 1:  # once per engine; the counts keep the rest
            logger.warning(
                "MoE routes: engine request %s has no recorded route for %d of the %d positions it computed; "
                "they go to the trainer as -1 rows (routed live, counted in routes_live_fraction). Either the "
                "engine replays CUDA graphs (the routers' capture hook never runs: RolloutWorker needs "
                "enforce_eager=True to record routes) or vLLM's internal request ids no longer are "
                "'<id>-<suffix>' (rlmega/rollout/route_store.py matches them). Further cases are counted "
                "silently (RolloutWorker.routes_missing()).",
                engine_id,
                missing,
                len(must_have),
            )


async def start_recording(engine) -> EngineRoutes:
    """Turn route capture on in every worker of ``engine`` (an AsyncLLM); TP rank 0's layout."""
    info = next(i for i in await engine.collective_rpc("rlmega_record_routes") if i is not None)
    return EngineRoutes(len(info["layers"]), info["topk"], info["num_experts"])


def fit_rows(routes: np.ndarray, n: int) -> np.ndarray:
    """``routes`` cut or padded with -1 rows to ``n`` rows.

    Off by one on purpose: the engine never computes the last sampled token (it is sampled from the
    forward of the token before, and the request ends), so its row stays -1 for the trainer's live
    router; and a response cut short by a stop string across a cut drops the rows after its end.
    """
    if len(routes) >= n:
        return routes[:n].copy()
    out = np.full((n, *routes.shape[1:]), -1, dtype=np.int16)
    out[: len(routes)] = routes
    return out
