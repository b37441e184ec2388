"""The routes a RolloutWorker's engine recorded, per engine request, laid onto each Sample (MoE, R3).

RolloutWorker (rlmega/workers/rollout.py) side of route capture; the engine side, which records them
inside vLLM's worker, is ``rlmega_record_routes`` / ``rlmega_take_routes`` in
rlmega/workers/vllm_extension.py and its store, rlmega/workers/route_store.py.

    routes = await start_recording(engine)          # EngineRoutes: (num_moe_layers, topk) per row
    rows = routes.empty()                           # (0, layers, topk) int16
    rows = await routes.take(engine, engine_id, rows)   # after each engine request (part) ends
    sample_rows = fit_rows(rows, len(prompt) + len(response))

Rows are int16 (positions, num_moe_layers, topk), row j = position j of prompt + response, -1 where
no route was recorded (``Sample.routed_experts``).
"""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


class EngineRoutes:
    """What one engine records: its MoE layout, and the taking of each engine request's rows."""

    def __init__(self, num_layers: int, topk: int, num_experts: int):
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts

    @property
    def shape(self) -> tuple[int, int]:
        """(num_moe_layers, topk) of each row."""
        return self.num_layers, self.topk

    def empty(self) -> np.ndarray:
        return np.full((0, self.num_layers, self.topk), -1, dtype=np.int16)

    async def take(self, engine, engine_id: str, routes: np.ndarray) -> np.ndarray:
        """``routes`` with the rows the engine recorded for one engine request (a part) laid over it.

        A part computes prompt + tokens so far (a resumed part re-prefills them on the new weights) and
        each token it samples but the last; its rows replace the older ones wherever it computed a
        position: a position keeps the routes of its latest computation, the one its final KV came from
        (a prefix-cache hit computes nothing and keeps the older row).
        """
        try:
            answers = await engine.collective_rpc("rlmega_take_routes", args=([engine_id],))
        except Exception as exc:  # the engine is gone: the part's own error is the one to report
            logger.warning("routes of %s not taken: %r", engine_id, exc)
            return routes
        got = next(a for a in answers if a is not None).get(engine_id)
        if got is None:  # nothing computed (aborted while queued)
            return routes
        data, shape = got
        part = np.frombuffer(data, dtype=np.int16).reshape(shape)
        routes = fit_rows(routes, max(len(routes), len(part)))
        computed = part[:, 0, 0] != -1
        routes[: len(part)][computed] = part[computed]
        return routes


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
