"""The families megatron-core needed help with, on the Megatron learner: packed RL log-probs equal transformers' on
each sample alone, RL steps at other layouts equal one process, and a checkpoint saved at a layout loads at TP1 with
its log-probs. Logits and the bit-exact HF round trip at every layout are tests/multiproc/test_hf_parity.py's.

DeepSeek-V3 (multi-latent attention, the sigmoid router with its correction bias over 2 groups, a shared expert, a
dense first layer): TP2+SP x EP2 and TP2 x PP2, routes replayed (R3); the TP2+SP x EP2 checkpoint.
Gemma 3 (sliding-window layers with their own RoPE base, post-norms, norms centred on 0, the embedding scale, tied;
rlmega/megatron/gemma3.py): responses longer than the window of 8, packed several to a row; TP2+SP (the post-norms'
gradients summed over TP: under SP each rank normalises its share of the tokens) and PP2 x VPP2; the TP2+SP
checkpoint.

What the layouts prove beyond the forward: the gradients of what every TP rank shares. With the local spec's
column-parallel latent down-projections the rope part of the kv latent missed the other TP ranks' heads in its
gradient (TP2+SP's grad norm 9.2e-5 off TP1's at the first step, 8e-4 at the second); rlmega replicates them
(rlmega/megatron/mla.py), and marks the latent q/kv norms sequence-parallel so their gradients are summed over TP
(megatron-core sums the q norm's by its name, not the kv norm's: ``kv_layernorm`` lacks ``k_layernorm``).
"""

import dataclasses

import torch
from transformers import AutoModelForCausalLM

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

E, K, LAYERS, N, STEPS = 8, 2, 2, 8, 2
KEYS = ("loss", "grad_norm", "pg_loss", "entropy", "routes_live_fraction")


def _batch(live: bool = True):
    batch = random_batch(N, seed=4, prompt_len=(3, 9), response_len=(13, 20))
    g = torch.Generator().manual_seed(9)
    routes = []
    # the MoE layer (layer 1) only: the dense first layer records no route
    for tokens in batch.tokens:
        r = torch.stack([torch.randperm(E, generator=g)[:K][None] for _ in range(len(tokens))]).to(
            torch.int16
        )
        if live:
            r[::5] = -1  # no route: routed live
        routes.append(r)
    return dataclasses.replace(batch, routed_experts=routes)


def _all_live(batch):
    """``batch`` with no route to replay: every token routed live (by the router's own scores and bias)."""
    return dataclasses.replace(
        batch, routed_experts=[torch.full_like(r, -1) for r in batch.routed_experts]
    )


def _gemma3_batch():
    return random_batch(N, seed=4, prompt_len=(3, 9), response_len=(13, 20), vocab=59)


def _actor(
    path: str,
    tp: int = 1,
    ep: int = 1,
    world: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    replay: bool = True,
    backend: str = "megatron",
    bias_rate: float = 0.0,
):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.fsdp.actor import FSDPActor
    from rlmega.megatron.actor import MegatronActor

    parallel = ParallelismConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        world_size=world,
    )
    actor = (MegatronActor if backend == "megatron" else FSDPActor)(
        ModelConfig(path=path, seed=3),
        parallel,
        OptimizerConfig(lr=1e-2),
        ActorConfig(
            backend=backend, max_tokens_per_micro_batch=56, moe_router_bias_update_rate=bias_rate
        ),
        AlgorithmConfig(
            kl_coef=0.0, entropy_coef=0.01, routing_replay="rollout" if replay else "none"
        ),
        temperature=1.0,
    )
    actor.setup()
    return actor


def _body(
    path: str,
    tp: int,
    ep: int,
    world: int,
    pp: int = 1,
    ckpt: str | None = None,
    vpp: int | None = None,
    family: str = "deepseek_v3",
    backend: str = "megatron",
):
    """STEPS RL steps; with ``ckpt``, the trained model saved there and its log-probs after the steps."""
    dense = family == "gemma3"
    actor = _actor(path, tp, ep, world, pp, vpp, replay=not dense, backend=backend)
    batch = _gemma3_batch() if dense else _batch()
    metrics, olds = [], []
    for _ in range(STEPS):
        old = actor.compute_logprobs(batch)
        metrics.append(actor.train_step(dataclasses.replace(batch, old_logprobs=old)))
        olds.append(old)
    out = {"metrics": [{k: m[k] for k in KEYS if k in m} for m in metrics], "old": olds}
    if ckpt:
        actor.save_checkpoint(ckpt, step=STEPS)
        out["after"] = actor.compute_logprobs(batch)
    actor.teardown()
    return out


def _load_body(path: str, ckpt: str, family: str = "deepseek_v3", live: bool = False):
    """World 1: the model of a checkpoint saved at another layout (resharded: model_only), its log-probs (``live``:
    every token routed by the loaded router, its bias included)."""
    actor = _actor(path, replay=family != "gemma3")
    actor.load_checkpoint(ckpt, model_only=True)
    batch = _gemma3_batch() if family == "gemma3" else _batch()
    out = actor.compute_logprobs(_all_live(batch) if live else batch)
    actor.teardown()
    return out


def _against_one(results: list, ref: dict, rel_limit: float, layout: tuple) -> tuple[float, float]:
    """Every rank's step metrics against one process's (relative, each within ``rel_limit``); returns (the worst
    relative metric, the worst |old log-prob| difference)."""
    worst_m = worst_lp = 0.0
    for rank, got in enumerate(results):
        for step, (g, r) in enumerate(zip(got["metrics"], ref["metrics"])):
            for k in r:
                rel = abs(g[k] - r[k]) / max(abs(r[k]), 1e-6)
                worst_m = max(worst_m, rel)
                assert rel <= rel_limit, (layout, rank, step, k, g[k], r[k])
        worst_lp = max(
            worst_lp,
            max(
                float((a - b).abs().max())
                for o, p in zip(got["old"], ref["old"])
                for a, b in zip(o, p)
            ),
        )
    return worst_m, worst_lp


def test_deepseek_v3_rl_on_megatron_matches_transformers_and_one_process(tmp_path):
    path = make_tiny_model(
        tmp_path / "dsv3",
        arch="deepseek_v3",
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_experts=E,
        top_k=K,
        moe_intermediate_size=32,
        seed=7,
    )
    ref = run_on_ranks(_body, 1, args=(str(path), 1, 1, 1), timeout_s=300)[0]
    # the first old log-probs (packed rows, R3) against transformers on each sample alone (live routing)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    worst = 0.0
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            p = int(batch.prompt_lens[i])
            want = torch.log_softmax(hf(toks[None]).logits[0], -1)[p - 1 : -1].gather(
                -1, toks[p:, None]
            )[:, 0]
            # the positions scoring the response (p-1 .. end-1) whose route was live; the replayed ones follow random
            # routes (the only MoE layer is the last: a route moves no other token's log-prob)
            live = batch.routed_experts[i][p - 1 : -1, 0, 0] < 0
            worst = max(worst, (want - ref["old"][0][i])[live].abs().max().item())
    print(f"packed log-probs vs transformers (live-routed tokens): {worst:.2e}")
    assert worst <= 5e-6, worst  # measured 4.8e-7
    ckpt = str(tmp_path / "ckpt")
    for tp, ep, pp, world in ((2, 2, 1, 4), (2, 1, 2, 4)):
        results = run_on_ranks(
            _body,
            world,
            args=(str(path), tp, ep, world, pp, ckpt if ep > 1 else None),
            timeout_s=420,
        )
        # metrics measured <= 4.2e-7
        worst_m, worst_lp = _against_one(results, ref, 2e-6, (tp, ep, pp))
        print(
            f"TP{tp}+SP x EP{ep} x PP{pp} vs world 1: metrics relative {worst_m:.2e}, old log-probs {worst_lp:.2e}"
        )
        assert worst_lp <= 1e-5  # measured 3.8e-6 (TP2+SP x EP2), 1.9e-6 (TP2 x PP2)
        # its checkpoint (MLA, the expert bias buffer, replicated latent projections) resharded to TP1
        if ep > 1:
            loaded = run_on_ranks(_load_body, 1, args=(str(path), ckpt), timeout_s=300)[0]
            gap = max(float((a - b).abs().max()) for a, b in zip(results[0]["after"], loaded))
            print(f"checkpoint of TP2+SP x EP2 loaded at TP1: log-probs {gap:.2e}")
            assert gap <= 1e-5  # measured 4.8e-7 (resharded: float32 sums in another order)


def test_gemma3_rl_on_megatron_matches_transformers_and_one_process(tmp_path):
    path = make_tiny_model(
        tmp_path / "gemma3",
        arch="gemma3",
        hidden_size=64,
        num_layers=4,
        num_heads=2,
        tie_word_embeddings=True,
        seed=7,
    )
    ref = run_on_ranks(_body, 1, args=(str(path), 1, 1, 1, 1, None, None, "gemma3"), timeout_s=300)[
        0
    ]
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    batch = _gemma3_batch()
    worst = 0.0
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            p = int(batch.prompt_lens[i])
            want = torch.log_softmax(hf(toks[None]).logits[0], -1)[p - 1 : -1].gather(
                -1, toks[p:, None]
            )[:, 0]
            worst = max(worst, (want - ref["old"][0][i]).abs().max().item())
    print(f"gemma3 packed log-probs vs transformers: {worst:.2e}")
    assert worst <= 5e-6, worst  # measured 4.8e-7
    # the gradient against transformers' (the FSDP learner, full parameters): the first step's metrics, grad norm
    # included (every weight's gradient: the embedding scale's, the post-norms', the tied head's)
    fsdp = run_on_ranks(
        _body, 1, args=(str(path), 1, 1, 1, 1, None, None, "gemma3", "fsdp"), timeout_s=300
    )[0]
    first = {
        k: abs(fsdp["metrics"][0][k] - v) / max(abs(v), 1e-6) for k, v in ref["metrics"][0].items()
    }
    print(f"gemma3 Megatron vs FSDP, first step: {first}")
    assert max(first.values()) <= 1e-5, first
    ckpt = str(tmp_path / "ckpt")
    for tp, pp, vpp in ((2, 1, None), (1, 2, 2)):
        results = run_on_ranks(
            _body,
            2,
            args=(str(path), tp, 1, 2, pp, ckpt if tp > 1 else None, vpp, "gemma3"),
            timeout_s=420,
        )
        # metrics measured: the first step's grad norm 2.2e-7 (TP2+SP), 7.5e-8 (PP2 x VPP2); 1.9e-6 at the second
        worst_m, worst_lp = _against_one(results, ref, 1e-5, (tp, pp, vpp))
        print(
            f"gemma3 TP{tp}{'+SP' if tp > 1 else ''} x PP{pp} x VPP{vpp} vs world 1: metrics relative "
            f"{worst_m:.2e}, old log-probs {worst_lp:.2e}"
        )
        # measured 4.8e-7 before any update; 1.05e-5 (TP2+SP), 4.8e-7 (PP2 x VPP2) after one at lr 1e-2 (Adam moves
        # weights whose float32 gradients differ in their last bits by up to lr)
        assert worst_lp <= 5e-5
        if tp > 1:
            loaded = run_on_ranks(_load_body, 1, args=(str(path), ckpt, "gemma3"), timeout_s=300)[0]
            gap = max(float((a - b).abs().max()) for a, b in zip(results[0]["after"], loaded))
            print(f"gemma3 checkpoint of TP2+SP loaded at TP1: log-probs {gap:.2e}")
            assert gap <= 1e-5  # measured 4.8e-7


RATE = 1e-3


def _bias_body(path: str, tp: int, ep: int, world: int, ckpt: str | None = None):
    """Aux-loss-free balancing: two RL steps, every route replayed (R3); the MoE layer's expert bias before and after
    each, the steps' metric, and the log-probs of a fresh live-routed forward (the bias picks live routes)."""
    from rlmega.megatron.actor import _expert_biases

    actor = _actor(path, tp, ep, world, bias_rate=RATE)
    batch = _batch(live=False)
    biases, changes = [_expert_biases(actor.policy)[0].clone()], []
    for _ in range(2):
        old = actor.compute_logprobs(batch)
        changes.append(
            actor.train_step(dataclasses.replace(batch, old_logprobs=old))[
                "moe_expert_bias_abs_change"
            ]
        )
        biases.append(_expert_biases(actor.policy)[0].clone())
    if ckpt:
        actor.save_checkpoint(ckpt, step=2)
    live = actor.compute_logprobs(_all_live(batch))
    actor.teardown()
    return {"biases": biases, "changes": changes, "live": live}


def test_deepseek_v3_aux_loss_free_bias_update_matches_the_routes_at_every_layout(tmp_path):
    """actor.moe_router_bias_update_rate: after each optimizer step every expert's correction bias moves by + rate
    if the step routed it fewer tokens than the mean, - rate if more (counted from the replayed routes themselves,
    over every token the forward saw), the same at TP2+SP x EP2 (counts summed over TP x DP) as in one process; a
    checkpoint carries the moved bias (a live-routed forward after loading it at TP1 gives the same log-probs)."""
    path = make_tiny_model(
        tmp_path / "dsv3",
        arch="deepseek_v3",
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_experts=E,
        top_k=K,
        moe_intermediate_size=32,
        seed=7,
    )
    one = run_on_ranks(_bias_body, 1, args=(str(path), 1, 1, 1), timeout_s=300)[0]
    counts = torch.bincount(
        torch.cat([r.reshape(-1).long() for r in _batch(live=False).routed_experts]), minlength=E
    ).double()
    want = RATE * torch.sign(counts.mean() - counts)
    for step in range(2):
        moved = (one["biases"][step + 1] - one["biases"][step]).double()
        print(f"step {step}: bias moved {moved.tolist()}, expected from the routes {want.tolist()}")
        # float32 bias + 1e-3: <= 6e-8 rounding
        assert torch.allclose(moved, want, atol=1e-7), (moved, want)
        assert abs(one["changes"][step] - want.abs().mean().item()) <= 1e-7
    ckpt = str(tmp_path / "ckpt")
    four = run_on_ranks(_bias_body, 4, args=(str(path), 2, 2, 4, ckpt), timeout_s=420)
    for rank, got in enumerate(four):
        assert all(torch.equal(a, b) for a, b in zip(got["biases"], one["biases"])), rank
    loaded = run_on_ranks(
        _load_body, 1, args=(str(path), ckpt, "deepseek_v3", True), timeout_s=300
    )[0]
    gap = max(float((a - b).abs().max()) for a, b in zip(four[0]["live"], loaded))
    print(f"live-routed log-probs after loading the TP2+SP x EP2 checkpoint at TP1: {gap:.2e}")
    assert gap <= 1e-5
