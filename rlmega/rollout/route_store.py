"""Inside vLLM's worker (TP rank 0): the routes its MoE routers picked, per engine request (R3).

``RolloutExtension.rlmega_record_routes`` (rlmega/rollout/vllm_extension.py) hooks each router's
``capture_fn`` to ``capture`` and wraps the model runner's step so that ``begin_step`` / ``end_step``
frame each forward; ``rlmega_take_routes`` hands a request's rows out with ``take``. The RolloutWorker
side that lays them onto samples is rlmega/rollout/engine_routes.py.

    store = RouteStore(num_layers=2, topk=2)
    store.layout = (["a#0-1f2e3d4c"], np.array([6]), np.array([0]))   # the step's requests, tokens, starts
    store.begin_step(finished_req_ids=set()); store.capture(0, ids0); store.capture(1, ids1); store.end_step()
    store.take(["a#0"])   # {"a#0": (bytes, (6, 2, 2))}
"""

from __future__ import annotations

import time

import numpy as np
import torch

_ROUTE_TTL_S = 600.0  # routes of a request that ended and was never taken are dropped after this


class RouteStore:
    """Per engine request: int16 (positions, num_moe_layers, topk), -1 rows until computed (rank 0 only).

    Filled one step at a time: the routers' rows of the step are held (``capture``) and handed to the
    requests of the step's layout at ``end_step``. Requests that vLLM reports finished (aborted or
    done) and nobody took within _ROUTE_TTL_S are dropped, so a long run does not leak.
    """

    def __init__(self, num_layers: int, topk: int):
        self.num_layers, self.topk = num_layers, topk
        self.rows: dict[str, np.ndarray] = {}  # internal request id -> array
        # internal request id -> when vLLM reported it ended
        self.finished: dict[str, float] = {}
        # (req ids, scheduled tokens, computed tokens) of this step
        self.layout = None
        self.step: dict[int, torch.Tensor] = {}  # MoE layer index -> (tokens, topk) of this step

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.step[layer] = topk_ids.detach().clone()  # a router may reuse its output buffer

    def begin_step(self, finished_req_ids) -> None:
        self.layout, self.step = None, {}
        now = time.monotonic()
        for rid in finished_req_ids or ():
            if rid in self.rows:
                self.finished.setdefault(rid, now)
        for rid, when in list(self.finished.items()):
            if now - when > _ROUTE_TTL_S or rid not in self.rows:
                self.rows.pop(rid, None)
                del self.finished[rid]

    def end_step(self) -> None:
        layout, step, self.layout, self.step = self.layout, self.step, None, {}
        if layout is None or len(step) != self.num_layers:  # a warm-up / dummy run: no requests
            return
        # (T, layers, k)
        ids = torch.stack([step[i] for i in range(self.num_layers)], dim=1).cpu().numpy()
        offset = 0
        for rid, count, start in zip(*layout):
            count, start = int(count), int(start)
            arr = self.rows.get(rid)
            if arr is None or arr.shape[0] < start + count:
                grown = np.full(
                    (
                        max(2 * (0 if arr is None else arr.shape[0]), start + count, 64),
                        self.num_layers,
                        self.topk,
                    ),
                    -1,
                    dtype=np.int16,
                )
                if arr is not None:
                    grown[: arr.shape[0]] = arr
                arr = self.rows[rid] = grown
            arr[start : start + count] = ids[offset : offset + count]
            arr[start + count :] = -1  # a recomputed request (preempted) starts over from here
            offset += count

    def take(self, request_ids: list[str]) -> dict:
        """{id: (bytes, shape)} of the rows of each of ``request_ids`` (then forgotten); ids without rows
        are left out.

        ``request_ids`` are the ids given to ``AsyncLLM.generate``; vLLM 0.32 runs each as
        ``"<id>-<8 hex>"`` (``InputProcessor.assign_request_id``), the id the model runner (and so this
        store) sees. Matched as ``<id>`` or ``<id>-<suffix without '-'>`` (not by the suffix's length):
        if vLLM changes its suffix otherwise, nothing matches, and the RolloutWorker warns and counts
        the missing rows (rlmega/rollout/engine_routes.py) instead of returning -1 rows silently.
        """
        wanted, out = set(request_ids), {}
        for rid in list(self.rows):
            owner = rid if rid in wanted else rid.rpartition("-")[0]
            if owner not in wanted:
                continue
            arr = self.rows.pop(rid)
            self.finished.pop(rid, None)
            filled = _last_filled(arr)
            out[owner] = (arr[:filled].tobytes(), (filled,) + arr.shape[1:])
        return out


def _last_filled(arr) -> int:
    """Rows of ``arr`` (positions, layers, topk) up to and including its last recorded one."""
    filled = (arr[:, 0, 0] != -1).nonzero()[0]
    return int(filled[-1]) + 1 if len(filled) else 0
