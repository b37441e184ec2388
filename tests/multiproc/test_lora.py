"""LoRA on the FSDP learner (actor.lora, issue 41): peft's adapters on a frozen base.

A tiny Qwen2 runs three RL steps (GRPO-style loss with a k3 KL to the reference) with rank-4 adapters on
q/k/v/o and the MLP projections, on one rank and on two (DP2). Checked:
- the policy starts as the base exactly (B = 0) and the reference is the base throughout (the policy with
  its adapters off: no second model);
- only the adapters train: every base weight is bit-identical after the steps, and Adam holds state for
  the adapters alone;
- DP2 equals one process;
- the weight stream a sync sends (adapters merged, HF names) equals the exported merged model, and peft
  loads the exported adapter folder onto model.path and gives the trainer's log-probs;
- a checkpoint after step 2, loaded by a fresh actor, gives the uninterrupted run's step 3 exactly;
- a full-parameter run's checkpoint resumes into a LoRA run (its weights the base, the adapters at zero: the
  same log-probs), and a LoRA checkpoint into a full-parameter run is refused, naming actor.lora.
"""

import torch

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.testing.rl_step import step_with_reference
from rlmega.demo.tiny_model import make_tiny_model

N, RANK, ALPHA = 8, 4, 8.0
KEYS = ("loss", "grad_norm", "pg_loss", "kl_ref")


def _actor(path: str, world: int, rank: int = RANK):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        LoraConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.fsdp.actor import FSDPActor

    actor = FSDPActor(
        ModelConfig(path=path),
        ParallelismConfig(1, 1, None, world),
        OptimizerConfig(lr=1e-2),
        ActorConfig(
            backend="fsdp", max_tokens_per_micro_batch=256, lora=LoraConfig(rank=rank, alpha=ALPHA)
        ),
        AlgorithmConfig(kl_coef=0.05, entropy_coef=0.0, kl_estimator="k3"),
    )
    actor.setup()
    return actor


def _step(actor, batch):
    return step_with_reference(actor, batch, KEYS)


def _body(path: str, world: int, out: str | None):
    actor = _actor(path, world)
    batch = random_batch(N, seed=1)
    lp0, ref0 = actor.compute_logprobs(batch), actor.compute_ref_logprobs(batch)
    metrics, refs = zip(*[_step(actor, batch) for _ in range(2)])
    metrics = list(metrics)
    if out:
        actor.save_checkpoint(f"{out}/ckpt", step=2)
    m3, ref3 = _step(actor, batch)
    metrics.append(m3)
    lp3 = actor.compute_logprobs(batch)
    res = {"lp0": lp0, "ref0": ref0, "refs": [*refs, ref3], "lp3": lp3, "metrics": metrics}
    if out:
        res["model"] = {k: v.cpu().clone() for k, v in actor.policy.iter_model_tensors()}
        res["merged"] = {k: v.cpu().clone() for k, v in actor.policy.iter_full_tensors()}
        opt = actor.policy.optimizer
        res["adam"] = sum(
            v.numel() for st in opt.state.values() for k, v in st.items() if k != "step"
        )
        actor.export_hf(f"{out}/hf")
    actor.teardown()
    return res


def _resume_body(path: str, out: str):
    actor = _actor(path, 1)
    assert actor.load_checkpoint(f"{out}/ckpt")[0] == 2
    m3, _ = _step(actor, random_batch(N, seed=1))
    actor.teardown()
    return m3


def _full_to_lora_body(path: str, out: str):
    """A full-parameter step, its checkpoint into a LoRA actor; a LoRA checkpoint into a full actor."""
    batch = random_batch(N, seed=1)
    full = _actor(path, 1, rank=0)
    _step(full, batch)
    full.save_checkpoint(f"{out}/full", step=1)
    want = full.compute_logprobs(batch)
    try:
        full.load_checkpoint(f"{out}/ckpt")
        refused = ""
    except ValueError as e:
        refused = str(e)
    full.teardown()
    actor = _actor(path, 1)
    assert actor.load_checkpoint(f"{out}/full")[0] == 1
    got, ref = actor.compute_logprobs(batch), actor.compute_ref_logprobs(batch)
    _step(actor, batch)
    after = actor.compute_logprobs(batch)
    actor.teardown()
    return {"want": want, "got": got, "ref": ref, "after": after, "refused": refused}


def _max(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_lora_fsdp_trains_adapters_only_against_the_base_and_exports_for_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = str(
        make_tiny_model(
            tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, seed=1
        )
    )
    out = str(tmp_path / "run")
    one = run_on_ranks(_body, 1, args=(path, 1, out), timeout_s=300)[0]
    two = run_on_ranks(_body, 2, args=(path, 2, None), timeout_s=300)[0]
    resumed = run_on_ranks(_resume_body, 1, args=(path, out), timeout_s=300)[0]
    switched = run_on_ranks(_full_to_lora_body, 1, args=(path, out), timeout_s=300)[0]

    # B = 0: the policy starts as the base; the reference is the base at every step
    assert _max(one["lp0"], one["ref0"]) == 0.0
    assert all(_max(r, one["ref0"]) == 0.0 for r in one["refs"])
    moved = _max(one["lp3"], one["lp0"])
    assert moved > 0.1, moved  # the adapters learned (0.78 measured)
    assert one["metrics"][0]["kl_ref"] == 0 < one["metrics"][2]["kl_ref"]
    # only the adapters train
    base = load_file(f"{path}/model.safetensors")
    frozen = {k: v for k, v in one["model"].items() if ".lora_" not in k}
    assert all(torch.equal(v, base[k.replace(".base_layer.", ".")]) for k, v in frozen.items())
    adapters = sum(v.numel() for k, v in one["model"].items() if ".lora_" in k)
    assert one["adam"] == 2 * adapters  # exp_avg and exp_avg_sq of the adapters, nothing else
    # DP2 equals one process
    rel = max(
        abs(g[k] - r[k]) / max(abs(r[k]), 1e-2)
        for g, r in zip(two["metrics"], one["metrics"])
        for k in KEYS
    )
    print(
        f"DP2 vs one process: metrics {rel:.2e}, log-probs after 3 steps {_max(two['lp3'], one['lp3']):.2e}"
    )
    assert rel <= 1e-5 and _max(two["lp3"], one["lp3"]) <= 1e-5
    # the resumed step 3 is the uninterrupted one
    assert resumed == one["metrics"][2], (resumed, one["metrics"][2])
    # a full-parameter checkpoint into LoRA: the saved policy, as the base and the reference; then it trains
    assert (
        _max(switched["got"], switched["want"]) == 0.0
        and _max(switched["ref"], switched["want"]) == 0.0
    )
    assert _max(switched["after"], switched["want"]) > 1e-3
    assert (
        "holds a LoRA run's adapters" in switched["refused"] and "actor.lora" in switched["refused"]
    )
    # the sync's stream (adapters merged, HF names) is the exported merged model
    merged = load_file(f"{out}/hf/merged/model.safetensors")
    assert set(one["merged"]) >= set(merged) and all(
        torch.equal(one["merged"][k], merged[k]) for k in merged
    )
    # peft loads the adapter folder onto model.path: the trainer's log-probs
    batch = random_batch(N, seed=1)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), f"{out}/hf"
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(f"{out}/hf/merged", dtype=torch.float32).eval()
    with torch.no_grad():
        for model, limit in ((peft_model, 1e-5), (plain, 1e-5)):  # 2.4e-7 and 4.8e-7 measured
            lps = [
                torch.log_softmax(model(t[None]).logits[0].float(), -1)[p - 1 : -1].gather(
                    -1, t[p:, None]
                )[:, 0]
                for t, p in zip(batch.tokens, batch.prompt_lens.tolist())
            ]
            print(type(model).__name__, "vs the trainer", _max(lps, one["lp3"]))
            assert _max(lps, one["lp3"]) <= limit
