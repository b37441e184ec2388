"""DeepSeek-V3 on the Megatron learner (multi-latent attention, the sigmoid router with its correction bias over
2 groups, a shared expert, a dense first layer): packed RL log-probs equal transformers', and RL steps at
TP2+SP x EP2 and TP2 x PP2, routes replayed (R3), equal one process; the trained TP2+SP x EP2 model's checkpoint
loads at TP1 with its log-probs. Logits and the bit-exact HF round trip at
every layout are tests/multiproc/test_hf_parity.py's.

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
from rlmega.tiny_model import make_tiny_model

E, K, LAYERS, N, STEPS = 8, 2, 2, 8, 2
KEYS = ("loss", "grad_norm", "pg_loss", "entropy", "routes_live_fraction")


def _batch():
    batch = random_batch(N, seed=4, prompt_len=(3, 9), response_len=(13, 20))
    g = torch.Generator().manual_seed(9)
    routes = []
    for tokens in batch.tokens:  # the MoE layer (layer 1) only: the dense first layer records no route
        r = torch.stack([torch.randperm(E, generator=g)[:K][None] for _ in range(len(tokens))]).to(torch.int16)
        r[::5] = -1  # no route: routed live
        routes.append(r)
    return dataclasses.replace(batch, routed_experts=routes)


def _actor(path: str, tp: int = 1, ep: int = 1, world: int = 1, pp: int = 1):
    from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.actor import MegatronActor

    parallel = ParallelismConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, world_size=world)
    actor = MegatronActor(
        ModelConfig(path=path, seed=3), parallel, OptimizerConfig(lr=1e-2),
        ActorConfig(max_tokens_per_micro_batch=56), AlgorithmConfig(kl_coef=0.0, entropy_coef=0.01,
                                                                     routing_replay="rollout"), temperature=1.0)
    actor.setup()
    return actor


def _body(path: str, tp: int, ep: int, world: int, pp: int = 1, ckpt: str | None = None):
    """STEPS RL steps; with ``ckpt``, the trained model saved there and its log-probs after the steps."""
    actor = _actor(path, tp, ep, world, pp)
    batch = _batch()
    metrics, olds = [], []
    for _ in range(STEPS):
        old = actor.compute_logprobs(batch)
        metrics.append(actor.train_step(dataclasses.replace(batch, old_logprobs=old)))
        olds.append(old)
    out = {"metrics": [{k: m[k] for k in KEYS} for m in metrics], "old": olds}
    if ckpt:
        actor.save_checkpoint(ckpt, step=STEPS)
        out["after"] = actor.compute_logprobs(batch)
    actor.teardown()
    return out


def _load_body(path: str, ckpt: str):
    """World 1: the model of a checkpoint saved at another layout (resharded: model_only), its log-probs."""
    actor = _actor(path)
    actor.load_checkpoint(ckpt, model_only=True)
    out = actor.compute_logprobs(_batch())
    actor.teardown()
    return out


def test_deepseek_v3_rl_on_megatron_matches_transformers_and_one_process(tmp_path):
    path = make_tiny_model(tmp_path / "dsv3", arch="deepseek_v3", hidden_size=64, num_layers=LAYERS, num_heads=2,
                           num_experts=E, top_k=K, moe_intermediate_size=32, seed=7)
    ref = run_on_ranks(_body, 1, args=(str(path), 1, 1, 1), timeout_s=300)[0]
    # the first old log-probs (packed rows, R3) against transformers on each sample alone (live routing)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    worst = 0.0
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            p = int(batch.prompt_lens[i])
            want = torch.log_softmax(hf(toks[None]).logits[0], -1)[p - 1:-1].gather(-1, toks[p:, None])[:, 0]
            # the positions scoring the response (p-1 .. end-1) whose route was live; the replayed ones follow random
            # routes (the only MoE layer is the last: a route moves no other token's log-prob)
            live = batch.routed_experts[i][p - 1:-1, 0, 0] < 0
            worst = max(worst, (want - ref["old"][0][i])[live].abs().max().item())
    print(f"packed log-probs vs transformers (live-routed tokens): {worst:.2e}")
    assert worst <= 5e-6, worst  # measured 4.8e-7
    ckpt = str(tmp_path / "ckpt")
    for tp, ep, pp, world in ((2, 2, 1, 4), (2, 1, 2, 4)):
        results = run_on_ranks(_body, world, args=(str(path), tp, ep, world, pp, ckpt if ep > 1 else None),
                               timeout_s=420)
        worst_m = worst_lp = 0.0
        for rank, got in enumerate(results):
            for step, (g, r) in enumerate(zip(got["metrics"], ref["metrics"])):
                for k in KEYS:
                    rel = abs(g[k] - r[k]) / max(abs(r[k]), 1e-6)
                    worst_m = max(worst_m, rel)
                    assert rel <= 2e-6, (tp, ep, pp, rank, step, k, g[k], r[k])  # measured <= 4.2e-7
            worst_lp = max(worst_lp, max(float((a - b).abs().max()) for o, p in zip(got["old"], ref["old"])
                                         for a, b in zip(o, p)))
        print(f"TP{tp}+SP x EP{ep} x PP{pp} vs world 1: metrics relative {worst_m:.2e}, old log-probs {worst_lp:.2e}")
        assert worst_lp <= 1e-5  # measured 3.8e-6 (TP2+SP x EP2), 1.9e-6 (TP2 x PP2)
        if ep > 1:  # its checkpoint (MLA, the expert bias buffer, replicated latent projections) resharded to TP1
            loaded = run_on_ranks(_load_body, 1, args=(str(path), ckpt), timeout_s=300)[0]
            gap = max(float((a - b).abs().max()) for a, b in zip(results[0]["after"], loaded))
            print(f"checkpoint of TP2+SP x EP2 loaded at TP1: log-probs {gap:.2e}")
            assert gap <= 1e-5  # measured 4.8e-7 (resharded: float32 sums in another order)
