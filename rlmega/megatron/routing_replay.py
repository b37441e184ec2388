"""MoE routing replay in the Megatron actor: record the routers' top-k, or force given top-k.

megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) gives each TopKRouter an instance
whose ``get_replay_topk`` picks the experts. Its own controls are process-global (a static list of
every instance ever built, the reference model's and any rebuilt model's included) and its
REPLAY_FORWARD replays every token. Ours, per model and per micro-batch:

- ``ModelRoutes(chunks)`` finds the instances of *this* model's routers (so a reference model in
  the same process, with its own instances, is never touched) and maps each to its model-wide MoE
  layer index (``router.layer_number``, global across pipeline stages and virtual chunks).
- ``ModelRoutes.micro_batch(chunk_index, rows, replay)`` scopes one forward of one chunk: with
  ``replay`` and ``rows`` (micro-batch rows (B, S, M, K), -1 = no route) the routers replay them,
  otherwise they route live; either way each router keeps the experts it used and its live top-k. It
  is entered inside the
  pipeline schedule's forward_step, i.e. per micro-batch and per chunk, right around the forward.

Mixed rows: megatron's REPLAY_FORWARD would gather scores at index -1. Rows without a recorded
route (the last sampled token, which the engine never processed; tool-output tokens; padding) must be
routed by the trainer's own router, so our ``get_replay_topk`` always computes the live top-k (it
is needed anyway for the ``router_mismatch`` metric) and takes the target only on rows that have
one (a row holding any -1 is routed live as a whole: a half-recorded top-k is no route). Probabilities
are then ``scores.gather(1, used)``: for live rows that equals torch.topk's values bit for bit, so a
fully live "replay" is the plain forward.

Activation recomputation is refused by the Megatron actor (actor.activation_checkpointing), so no
router runs again in the backward and REPLAY_BACKWARD's queue is not needed; ``ModelRoutes`` refuses a
model whose config recomputes.

Token order: the router sees hidden states (S, B, H) flattened, token (s, b) at index s * B + b;
our micro-batch rows are (B, S), row-major. ``to_router_order`` / ``from_router_order`` convert
(rlmega.data.micro_batches.pack_routes / unpack_rows go between samples and rows).
Under sequence parallelism each tensor-parallel rank's router sees its part of the sequence, (S/TP, B)
flattened: s-major, so it is the TP rank's contiguous block of the router order. A replayed target is
cut to that block; what the routers used (and chose live) is gathered back over the TP group before it
is recorded or counted, so every TP rank holds the whole micro-batch's routes, as without SP.
Under context parallelism each CP rank's routers see its share of the row (context_parallel.py): a
replayed target is cut to that share first (then to the TP block), and what the routers used is
gathered back over CP into row order, so every rank records and counts whole rows.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

from rlmega.data.micro_batches import unpack_rows
from rlmega.megatron.hf_io import unwrap
from rlmega.megatron.runtime import for_collective


# ---- pure functions: rows <-> router order -----------------------------------------------------
def to_router_order(rows: torch.Tensor, layer: int) -> torch.Tensor:
    """(B, S, M, K) micro-batch rows (micro_batches.pack_routes) -> (S * B, K) int64 targets of MoE
    layer ``layer``, in the router's s-major token order."""
    B, S, _, K = rows.shape
    return rows[:, :, layer].transpose(0, 1).reshape(S * B, K).long()


def from_router_order(indices: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """(S * B, K) router-order indices -> (B, S, K) rows."""
    return indices.reshape(S, B, -1).transpose(0, 1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., K) x (..., K) -> (...) bool: the two top-k rows name the same experts (order ignored)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def moe_layer_numbers(num_layers: int, moe_layer_freq) -> list[int]:
    """Model-wide layer numbers (1-based, Megatron's layer_number) of the MoE layers, in order."""
    if isinstance(moe_layer_freq, int):
        pattern = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    return [i + 1 for i, p in enumerate(pattern) if p]


# ---- the routers of one model --------------------------------------------------------------------
class _State:
    """One router's view of the current micro-batch (set by ModelRoutes.micro_batch)."""

    def __init__(self, target: torch.Tensor | None):
        self.target = target  # (T, K) int64 router order, -1 rows = route live; None = all live
        self.used: torch.Tensor | None = None  # (T, K) the experts this forward used
        self.live: torch.Tensor | None = None  # (T, K) the router's own top-k


def _get_replay_topk(
    replay, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
):
    """Replaces RouterReplay.get_replay_topk on our instances (see the module docstring)."""
    probs, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    state: _State | None = getattr(replay, "rlmega_state", None)
    if state is None:  # outside ModelRoutes.micro_batch: plain routing
        return probs, live
    used = live
    if state.target is not None:
        target = state.target.to(scores.device)
        if target.shape != live.shape:
            raise RuntimeError(
                f"routing replay: {tuple(target.shape)} target routes for a router that sees "
                f"{tuple(live.shape)} (tokens, topk)"
            )
        used = torch.where((target < 0).any(-1, keepdim=True), live, target)
        probs = scores.gather(1, used)
    state.used, state.live = used.detach(), live.detach()
    return probs, used


class ModelRoutes:
    """The RouterReplay instances of one model (its list of chunks), by chunk and MoE layer index."""

    def __init__(self, chunks: list):
        self.by_chunk: list[list[tuple[int, object]]] = []
        for chunk in chunks:
            model = unwrap(chunk)
            config = model.config
            if getattr(config, "recompute_granularity", None) is not None:
                raise ValueError(
                    "routing replay with activation recomputation is not supported by the megatron "
                    "actor (the recomputed forward would route again); "
                    "set actor.activation_checkpointing=false"
                )
            numbers = moe_layer_numbers(config.num_layers, config.moe_layer_freq)
            found = []
            for module in model.modules():
                if isinstance(module, TopKRouter) and module.router_replay is not None:
                    replay = module.router_replay
                    replay.get_replay_topk = _get_replay_topk.__get__(replay)  # this instance only
                    found.append((numbers.index(module.layer_number), replay))
            self.by_chunk.append(found)
        self.num_moe_layers = len(numbers) if chunks else 0
        self.num_experts = int(config.num_moe_experts or 0) if chunks else 0
        self.topk = int(config.moe_router_topk) if chunks else 0
        self.local_layers = sorted(layer for found in self.by_chunk for layer, _ in found)
        # The TransformerConfig objects the routers read their loss coefficients from (at every forward),
        # and the coefficients as configured (actor.moe_aux_loss_coeff / moe_z_loss_coeff).
        self.configs = list({id(unwrap(c).config): unwrap(c).config for c in chunks}.values())
        self.aux_coeff = float(self.configs[0].moe_aux_loss_coeff or 0.0) if chunks else 0.0
        self.z_coeff = float(self.configs[0].moe_z_loss_coeff or 0.0) if chunks else 0.0
        self.num_layers = int(self.configs[0].num_layers) if chunks else 0
        # sequence parallelism: each TP rank's routers see its block of the router order (module docstring)
        self.sequence_parallel = bool(chunks and self.configs[0].sequence_parallel)
        # context parallelism: each CP rank's routers see its share of the row (context_parallel.py)
        self.cp = ps.get_context_parallel_world_size() if chunks else 1
        # either way each rank of the TP x CP group routes part of a micro-batch's tokens
        self.split = self.sequence_parallel or self.cp > 1
        # megatron-core 0.16 (router.apply_z_loss) divides the z-loss coefficient by the TP x CP group's size,
        # then each rank back-propagates its own tokens' z-loss into router weights whose gradients
        # finalize_model_grads sums over TP (sequence_parallel marks them) and CP (with DP): the sum is
        # 1 / (TP x CP) of the same loss at world 1 (measured: tests/multiproc/test_moe_sequence_parallel.py,
        # at TP2+SP and at CP2). The coefficient we hand it is TP x CP times larger, so actor.moe_z_loss_coeff
        # means the same at every layout. (The load-balancing loss needs nothing here: each rank scales its
        # share by its own token count. Both take CP's loss count, CP x N, in actor._aux_loss_factor.)
        tp = ps.get_tensor_model_parallel_world_size() if self.sequence_parallel else 1
        self.z_scale = tp * self.cp
        # The same on every rank (a pipeline stage without MoE layers still takes part in the
        # collectives of RoutePass's results): the model was built with the hooks and has MoE layers.
        self.enabled = bool(chunks and config.moe_enable_routing_replay and self.num_moe_layers)

    def check(self, routes: list[torch.Tensor], field: str = "batch.routed_experts") -> None:
        """Refuse routes this model cannot replay, naming the field."""
        if not routes:
            return
        shape = tuple(routes[0].shape[1:])
        if shape != (self.num_moe_layers, self.topk):
            raise ValueError(
                f"{field} has (num_moe_layers, topk) = {shape}, the model has "
                f"({self.num_moe_layers}, {self.topk}): the routes come from another model"
            )
        top = (
            max(int(r.max()) for r in routes if r.numel()) if any(r.numel() for r in routes) else -1
        )
        if top >= self.num_experts:
            raise ValueError(
                f"{field} names expert {top}; the model has {self.num_experts} experts per layer"
            )

    @contextmanager
    def loss_coefficients(self, factor: float):
        """Inside: the routers' aux / z-loss coefficients are the configured ones times ``factor``
        (0: neither loss is computed nor tracked, e.g. a placeholder micro-batch without real tokens).

        Megatron's routers read ``config.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` at every forward
        (TopKRouter.get_aux_loss_coeff, apply_z_loss); see ``aux_loss_factor`` for the factor's meaning.
        """
        for config in self.configs:
            config.moe_aux_loss_coeff = self.aux_coeff * factor
            config.moe_z_loss_coeff = (
                self.z_coeff * factor * self.z_scale if self.z_coeff * factor > 0 else None
            )
        try:
            yield
        finally:
            for config in self.configs:
                config.moe_aux_loss_coeff = self.aux_coeff
                config.moe_z_loss_coeff = self.z_coeff if self.z_coeff > 0 else None

    @contextmanager
    def micro_batch(self, chunk_index: int, rows: torch.Tensor | None, replay: bool, cp=None):
        """One forward of chunk ``chunk_index``; yields {layer: _State}, filled in by the forward.

        rows: (B, S, M, K) routes of the micro-batch or None; ``replay`` False only records. ``cp``: the
        micro-batch's context_parallel.CPShare under context parallelism (rows are then cut to its slots;
        its padding slots route live).
        """
        states = {}
        if rows is not None and replay and cp is not None:
            rows = cp.take(rows[0], -1)[None]  # (1, S_local, M, K)
        for layer, instance in self.by_chunk[chunk_index]:
            target = to_router_order(rows, layer) if (replay and rows is not None) else None
            if target is not None and self.sequence_parallel:
                target = target.chunk(ps.get_tensor_model_parallel_world_size())[
                    ps.get_tensor_model_parallel_rank()
                ]
            states[layer] = instance.rlmega_state = _State(target)
        try:
            yield states
        finally:
            for _, instance in self.by_chunk[chunk_index]:
                instance.rlmega_state = None


# ---- one pass over micro-batches: what the routers did ---------------------------------------------
# counts: (token, MoE layer) pairs on real tokens routed live in a replay pass / all real pairs /
# generated pairs whose live top-k set differs from the given routes / generated pairs with a given route
COUNT_KEYS = ("live_pairs", "real_pairs", "mismatch_pairs", "compared_pairs")


class RoutePass:
    """Routing bookkeeping of one pass (policy.forward_logprobs / train_micro_batches) on this rank.

    ``replay``: micro-batches with mb["routed_experts"] replay them (-1 rows live); otherwise every
    router routes live. Either way, per micro-batch and local MoE layer, it keeps the experts used
    (``record``: as per-sample routes), the counts of COUNT_KEYS and the tokens per expert. Every
    number is local (this rank's micro-batches and layers); ``merge_stage_routes`` / ``reduce_counts``
    combine ranks.
    """

    def __init__(
        self, routes: ModelRoutes, chunks: list, mbs: list[dict], replay: bool, record: bool
    ):
        self.routes, self.replay, self.record = routes, replay, record
        self.chunk_index = {id(c): i for i, c in enumerate(chunks)}
        self.mb_index = {id(mb): j for j, mb in enumerate(mbs)}
        self.mbs = mbs
        # micro-batch index -> (B, S, M, K) int16, -1 elsewhere
        self.recorded: dict[int, torch.Tensor] = {}
        self.counts = torch.zeros(len(COUNT_KEYS), dtype=torch.float64)
        # train passes: the factor on the aux / z-loss coefficients (aux_loss_factor); None = as configured
        self.aux_factor: float | None = None
        self.load = torch.zeros(routes.num_moe_layers, routes.num_experts, dtype=torch.float64)
        # sequence parallelism: per micro-batch, (each layer's tracked z-loss x this TP rank's valid tokens,
        # the valid tokens): megatron-core tracks each rank's mean over its own tokens (see z_loss_means)
        self.z_parts: dict[int, list] = {}

    @contextmanager
    def forward(self, chunk, mb: dict):
        """Around one chunk's forward of one micro-batch (inside the schedule's forward_step)."""
        rows = mb.get("routed_experts")
        factor = 1.0 if self.aux_factor is None else self.aux_factor
        if not bool(mb["real_tokens"].any()):
            # a placeholder micro-batch: no router loss (its mean over no token is 0/0)
            factor = 0.0
        z_before = _tracked("z_loss") if self.routes.split else None
        with (
            self.routes.micro_batch(
                self.chunk_index[id(chunk)], rows, self.replay, mb.get("cp")
            ) as states,
            self.routes.loss_coefficients(factor),
        ):
            yield
        if z_before is not None:
            z_after = _tracked("z_loss")  # (empty until megatron-core first tracks one)
            if z_after.numel():
                self._z_part(mb, z_after - z_before if z_before.numel() else z_after)
        self._account(mb, rows, states)

    def _z_part(self, mb: dict, z_means: torch.Tensor) -> None:
        """Keep this chunk's per-layer z-loss means (over this rank's valid tokens of ``mb``: its CP share's
        TP block) weighted by those tokens, so that ``z_loss_means`` can weigh the TP x CP ranks' means
        into the micro-batch's."""
        real = (
            mb["real_tokens"] if mb.get("cp") is None else mb["cp"].take(mb["real_tokens"], False)
        )
        real = real.view(mb["tokens"].shape)
        if self.routes.sequence_parallel:
            real = real.chunk(ps.get_tensor_model_parallel_world_size(), dim=1)[
                ps.get_tensor_model_parallel_rank()
            ]
        valid = float(real.sum())
        num, _ = self.z_parts.setdefault(self.mb_index[id(mb)], [torch.zeros_like(z_means), valid])
        num += z_means * valid

    def z_loss_means(self) -> torch.Tensor:
        """(num_layers,) float64: each layer's z-loss mean over every valid token of each micro-batch, summed
        over micro-batches, as megatron-core's tracker holds it at world 1. Collective over the TP x CP
        group."""
        order = sorted(self.z_parts)
        L = self.routes.num_layers
        parts = (
            torch.stack(
                [
                    torch.cat(
                        [
                            self.z_parts[j][0].double().cpu(),
                            torch.tensor([self.z_parts[j][1]], dtype=torch.float64),
                        ]
                    )
                    for j in order
                ]
            )
            if order
            else torch.zeros(0, L + 1, dtype=torch.float64)
        )
        parts = _all_reduce(parts, ps.get_tensor_and_context_parallel_group())
        return (
            (parts[:, :L] / parts[:, L:].clamp_min(1.0)).sum(0)
            if order
            else torch.zeros(L, dtype=torch.float64)
        )

    @torch.no_grad()
    def _account(self, mb: dict, rows: torch.Tensor | None, states: dict) -> None:
        cp = mb.get("cp")
        B, S = mb["tokens"].shape if cp is None else (1, cp.full_len)
        real, gen = mb["real_tokens"].view(B, S), mb["generated"].view(B, S)
        M = self.routes.num_moe_layers
        counts = torch.zeros(len(COUNT_KEYS), dtype=torch.float64)
        for layer, st in states.items():
            used_all, live_all = st.used, st.live
            # each TP rank routed its block: the whole micro-batch's on every rank
            if self.routes.sequence_parallel:
                used_all, live_all = _whole_sequence(used_all), _whole_sequence(live_all)
            # each CP rank routed its share of the row: the whole row on every rank
            if cp is not None:
                used_all, live_all = _whole_row(used_all, cp), _whole_row(live_all, cp)
            used = from_router_order(used_all, B, S).cpu()  # (B, S, K)
            live = from_router_order(live_all, B, S).cpu()
            if self.record:
                j = self.mb_index[id(mb)]
                if j not in self.recorded:
                    self.recorded[j] = torch.full((B, S, M, used.shape[-1]), -1, dtype=torch.int16)
                self.recorded[j][:, :, layer] = used.to(torch.int16)
            self.load[layer] += torch.bincount(
                used[real].flatten(), minlength=self.routes.num_experts
            ).double()
            if rows is None:
                continue
            target = rows[:, :, layer]
            has = ~(target < 0).any(-1)  # (B, S): a row with a -1 is routed live as a whole
            if self.replay:
                counts[0] += (real & ~has).sum()
                counts[1] += real.sum()
            compared = gen & has
            counts[2] += (compared & ~same_sets(live, target.long())).sum()
            counts[3] += compared.sum()
        self.counts += counts

    def recorded_routes(self) -> dict[int, torch.Tensor]:
        """{sample index: (L_i, M, K) int16} of this rank's samples, -1 on layers of other stages."""
        out = {}
        for j, rows in self.recorded.items():
            out.update(unpack_rows(rows, self.mbs[j]))
        return out


# ---- across ranks ---------------------------------------------------------------------------------
def _whole_sequence(block: torch.Tensor) -> torch.Tensor:
    """This TP rank's (S/TP * B, K) block of the router order -> the whole (S * B, K), on every TP rank."""
    group = ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return block
    local = for_collective(block.contiguous(), group)
    out = torch.empty(
        (local.shape[0] * size, *local.shape[1:]), dtype=local.dtype, device=local.device
    )
    dist.all_gather_into_tensor(out, local, group=group)
    return out.to(block.device)


def _whole_row(local: torch.Tensor, cp) -> torch.Tensor:
    """This CP rank's (S_local, K) routes of its share ``cp`` (a context_parallel.CPShare) -> the whole
    row's (S, K) in row order, on every CP rank."""
    group = ps.get_context_parallel_group()
    block = for_collective(local.contiguous(), group)
    out = torch.empty(
        (block.shape[0] * dist.get_world_size(group), *block.shape[1:]),
        dtype=block.dtype,
        device=block.device,
    )
    dist.all_gather_into_tensor(out, block, group=group)
    return out[cp.full_from_gathered.to(out.device)].to(local.device)


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return t
    out = for_collective(t, group)
    dist.all_reduce(out, op=op, group=group)
    return out.to(t.device)


def merge_stage_routes(
    local: dict[int, torch.Tensor], lengths: dict[int, int], shape: tuple[int, int]
) -> dict:
    """This rank's recorded routes with every pipeline stage's layers: {sample id: (L_i, M, K) int16}.

    Pipeline stages hold disjoint layers (-1 elsewhere, and expert ids >= 0): an element-wise max over
    the pipeline group merges them; tensor-parallel ranks recorded the same routes. Data-parallel ranks
    keep their own samples' (``exchange_routes`` moves them to the rank a later step needs them on).
    lengths: each sample's token count; shape: (num_moe_layers, topk).
    """
    order = sorted(local)
    flat = (
        torch.cat([local[i] for i in order]) if order else torch.zeros(0, *shape, dtype=torch.int16)
    )
    flat = _all_reduce(flat.int(), ps.get_pipeline_model_parallel_group(), dist.ReduceOp.MAX).to(
        torch.int16
    )
    return dict(zip(order, flat.split([lengths[i] for i in order])))


def exchange_routes(held: dict[int, torch.Tensor], needed: list[int]) -> dict[int, torch.Tensor]:
    """Collective over the data-parallel ranks: {sample id: routes} of this rank's ``needed`` samples, from
    whichever rank ``held`` them (ids no rank holds are left out).

    R2 records routes on the rank whose share of compute_logprobs held the sample; a train step's
    mini-batch may be planned onto another rank. Each rank says which ids it needs (small), then every
    rank in turn scatters to each other rank only what that one needs: no rank ever holds the whole
    batch's routes (12.9 GB at 512 x 32k tokens, 48 layers top-8: docs/moe.md).
    """
    group = ps.get_data_parallel_group_gloo()
    n, me = dist.get_world_size(group), dist.get_rank(group)
    wants = [None] * n
    dist.all_gather_object(wants, list(needed), group=group)
    out = {}
    for src in range(n):
        pieces = (
            [{i: held[i] for i in wants[d] if i in held} for d in range(n)] if src == me else None
        )
        got = [None]
        dist.scatter_object_list(got, pieces, src=dist.get_global_rank(group, src), group=group)
        out.update(got[0])
    return out


def reduce_counts(counts: torch.Tensor, load: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Sum COUNT_KEYS and the (M, E) tokens per expert over pipeline stages (disjoint layers) and
    data-parallel ranks (disjoint tokens); tensor-parallel ranks hold copies and are not summed."""
    both = torch.cat([counts, load.flatten()])
    both = _all_reduce(both, ps.get_pipeline_model_parallel_group())
    both = _all_reduce(both, ps.get_data_parallel_group())
    return dict(zip(COUNT_KEYS, both[: len(COUNT_KEYS)].tolist())), both[len(COUNT_KEYS) :].view_as(
        load
    )


def route_metrics(counts: dict, load: torch.Tensor) -> dict:
    """router_mismatch, routes_live_fraction (NaN where nothing was compared / replayed) and, per MoE
    layer, the expert load as max / mean tokens per expert (1 = balanced; num_experts / topk at most)."""
    out = {
        "router_mismatch": (
            counts["mismatch_pairs"] / counts["compared_pairs"]
            if counts["compared_pairs"]
            else float("nan")
        ),
        "routes_live_fraction": counts["live_pairs"] / counts["real_pairs"]
        if counts["real_pairs"]
        else float("nan"),
    }
    if load.numel() and float(load.sum()) > 0:
        ratio = load.max(1).values / load.mean(1).clamp_min(1e-12)
        out.update({f"moe_load_max_over_mean/layer_{m}": float(r) for m, r in enumerate(ratio)})
    return out


# ---- Megatron's own aux-loss tracking ----------------------------------------------------------------
def clear_aux_losses() -> None:
    """Zero Megatron's per-layer aux-loss tracker (before a train step's micro-batches)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def aux_loss_factor(loss_count: float, router_tokens: float) -> float:
    """The factor on the configured aux / z-loss coefficients that makes each term's gradient
    ``coeff * d(mean loss)/d(theta)``, whatever the RL loss's normalisation.

    With ``calculate_per_token_loss`` megatron-core (0.16: router.attach_and_log_load_balancing_loss,
    apply_z_loss) back-propagates each micro-batch's router loss times the micro-batch's token count
    T_mb (its non-padding tokens when the forward gets a padding mask), and finalize_model_grads
    divides every gradient by the global count of the RL loss, N (response tokens for token-mean,
    sequences for the seq-mean modes; summed over micro-batches and data-parallel ranks). So the term's
    gradient is coeff * sum_mb T_mb dL_mb / N. With factor N / T, T = sum_mb T_mb over every micro-batch
    and data-parallel rank, it is coeff * d(sum_mb T_mb L_mb / T): the coefficient weighs the
    token-weighted mean over the step's micro-batches of their router losses, as in Megatron pretraining
    (where N = T). N = 0 (nothing in the loss): megatron does not divide, the factor is 1 / T.
    """
    if router_tokens <= 0:
        return 0.0
    return (loss_count if loss_count > 0 else 1.0) / router_tokens


def _tracked(name: str) -> torch.Tensor:
    """megatron-core's tracker of router loss ``name``: (num_layers,) float64, summed since the last clear."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        return torch.zeros(0, dtype=torch.float64)
    return tracker[name]["values"].detach().double().cpu().clone()


def aux_loss_metrics(route_pass: RoutePass, num_micro_batches: int) -> dict:
    """The train step's MoE router losses as Megatron tracks them (moe_utils' save_to_aux_losses_tracker:
    per layer, summed over micro-batches, without their coefficients), averaged over the step's
    micro-batches with real tokens (``num_micro_batches``: over every data-parallel rank) and over MoE
    layers: "moe_load_balancing_loss" (actor.moe_aux_loss_coeff > 0), "moe_z_loss" (moe_z_loss_coeff > 0).
    Both are summed over pipeline stages (disjoint layers) and data-parallel ranks here (Megatron's own
    reduction averages the balancing loss over DP but leaves the z-loss rank-local). Collective on every
    rank whenever a coefficient is on (names fixed by the config, not by what this rank's tracker
    happened to record: a rank with only placeholder micro-batches records nothing). Clears the tracker.
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    routes = route_pass.routes
    names = [
        n
        for n, c in (("load_balancing_loss", routes.aux_coeff), ("z_loss", routes.z_coeff))
        if c > 0
    ]
    if not names:
        return {}
    L = routes.num_layers
    rows = []
    for n in names:
        tracked = _tracked(n)[:L]
        value = tracked if tracked.numel() else torch.zeros(L, dtype=torch.float64)
        if routes.split:  # each TP x CP rank tracked the loss of its own tokens
            # the load-balancing loss: each rank's share of one loss (its tokens' probabilities against the
            # micro-batch's expert counts): they add up; the z-loss: a mean per rank, weighed by tokens
            value = (
                _all_reduce(value, ps.get_tensor_and_context_parallel_group())
                if n == "load_balancing_loss"
                else route_pass.z_loss_means()
            )
        rows.append(value)
    values = torch.stack(rows)
    values = _all_reduce(values, ps.get_pipeline_model_parallel_group())
    values = _all_reduce(values, ps.get_data_parallel_group())
    clear_aux_losses_tracker()
    per = max(num_micro_batches, 1) * max(routes.num_moe_layers, 1)
    return {f"moe_{n}": float(v.sum()) / per for n, v in zip(names, values)}
