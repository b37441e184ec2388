"""bf16 mixed precision on CPU (Megatron's Float16Module, fp32 main params, fp32 log-probs) and the
colocated-GPU offload/onload of the trainer between rollouts, on one real gloo rank each.
"""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

# bf16 keeps 8 mantissa bits: a relative rounding of 2^-9 per op. Measured here over a 4-layer,
# 128-wide model: log-prob max abs diff 5.7e-3 against float32 (see test); 0.05 leaves room for other
# CPUs' summation orders while still catching a bf16 log-softmax (errors of 0.1 and more).
BF16_LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("m") / "qwen2",
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            num_layers=4,
            seed=5,
        )
    )


def _actor(path, dtype="float32", **actor_kw):
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=path, dtype=dtype),
        ParallelismConfig(),
        OptimizerConfig(lr=3e-3),
        ActorConfig(max_tokens_per_micro_batch=40, **actor_kw),
        AlgorithmConfig(kl_coef=0.0),
    )
    actor.setup(with_reference=False)
    return actor


def _bf16_body(path, out_dir):
    from megatron.core.transformer.module import Float16Module

    from rlmega.megatron import offload

    batch = random_batch(10, seed=1)
    fp32 = _actor(path)
    lp32 = fp32.compute_logprobs(batch)
    fp32.teardown()

    actor = _actor(path, "bfloat16")
    mm = actor.policy
    facts = {
        "wrapped": all(
            isinstance(c.module, Float16Module) for c in mm.model
        ),  # DDP(Float16Module(GPT))
        "param_dtypes": {str(p.dtype) for p in offload.model_params(mm.model)},
        "grad_dtypes": {str(g.dtype) for g in offload.model_grads(mm.model)},
        "main_param_dtypes": {str(p.dtype) for g in mm.optimizer.param_groups for p in g["params"]},
        "main_params": len(offload.main_params(mm.optimizer)),
    }
    lp = actor.compute_logprobs(batch)
    facts["logprob_dtypes"] = {str(x.dtype) for x in lp}
    facts["logprob_err"] = max(float((a - b).abs().max()) for a, b in zip(lp, lp32))
    facts["logprob_err_mean"] = float(torch.cat([(a - b).abs() for a, b in zip(lp, lp32)]).mean())
    sft = dataclasses.replace(batch, advantages=None)
    facts["sft_losses"] = [actor.sft_step(sft)["loss"] for _ in range(4)]
    # Checkpoint round trip: step on, load, and the parameters and fp32 main params are those saved.
    actor.save_checkpoint(f"{out_dir}/ckpt", 4)
    saved = [p.clone() for p in offload.model_params(mm.model)]
    saved_main = [p.clone() for p in offload.main_params(mm.optimizer)]
    actor.sft_step(sft)
    step, _ = actor.load_checkpoint(f"{out_dir}/ckpt")
    facts["ckpt_step"] = step
    facts["ckpt_params_equal"] = all(
        torch.equal(a, b) for a, b in zip(saved, offload.model_params(mm.model))
    )
    facts["ckpt_main_equal"] = all(
        torch.equal(a, b) for a, b in zip(saved_main, offload.main_params(mm.optimizer))
    )
    actor.export_hf(f"{out_dir}/hf")
    facts["embedding"] = mm.unwrapped()[0].embedding.word_embeddings.weight.detach().clone()
    actor.teardown()
    return facts


def test_bf16_step_runs_with_fp32_main_params_and_fp32_logprobs(hf_model, tmp_path):
    facts = run_on_ranks(_bf16_body, 1, args=(hf_model, str(tmp_path)), timeout_s=300)[0]
    assert facts["wrapped"], (
        "bf16 chunks must be wrapped in Float16Module as Megatron's get_model does"
    )
    assert facts["param_dtypes"] == {"torch.bfloat16"}
    assert facts["grad_dtypes"] == {"torch.float32"}  # DDP reduces grads in fp32
    assert facts["main_param_dtypes"] == {"torch.float32"} and facts["main_params"] > 0
    assert facts["logprob_dtypes"] == {"torch.float32"}
    print(
        f"bf16 vs fp32 log-probs: max {facts['logprob_err']:.2e}, mean {facts['logprob_err_mean']:.2e}; "
        f"bf16 SFT losses {facts['sft_losses']}"
    )
    assert facts["logprob_err"] < BF16_LOGPROB_ATOL
    losses = facts["sft_losses"]
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0], losses
    assert facts["ckpt_step"] == 4 and facts["ckpt_params_equal"] and facts["ckpt_main_equal"]
    # The export keeps bf16 and says so; transformers reads it.
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    shard = next((tmp_path / "hf").glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, facts["embedding"][: emb.shape[0]])


def _phases_body(path, cycle):
    from rlmega.megatron import offload

    actor = _actor(path, offload_while_generating=cycle)
    batch = random_batch(10, seed=1)
    metrics, released = [], {}
    for step in range(2):
        old = actor.compute_logprobs(batch)
        metrics.append(actor.train_step(dataclasses.replace(batch, old_logprobs=old)))
        if step == 0:  # what Roles.rollout_phase does around the weight sync
            kept = actor.offload_for_rollout(keep_params=True)
            released["params kept"] = sum(
                s.untyped_storage().nbytes() for s in offload.model_params(actor.policy.model)
            )
            full = actor.offload_for_rollout()
            released["params"] = sum(
                s.untyped_storage().nbytes() for s in offload.model_params(actor.policy.model)
            )
            released["grads"] = sum(
                s.untyped_storage().nbytes() for s in offload.model_grads(actor.policy.model)
            )
            released["optimizer state"] = sum(
                s.untyped_storage().nbytes()
                for s in offload.optimizer_state(actor.policy.optimizer)
            )
            released["kinds"] = (kept["offloaded"], full["offloaded"])
            released["after onload"] = actor.onload_for_training()["offloaded"]
    params = [p.detach().clone() for p in offload.model_params(actor.policy.model)]
    actor.teardown()
    return metrics, released, params


def test_offload_for_rollout_frees_everything_and_training_continues_bit_exactly(hf_model):
    plain, noop, params_plain = run_on_ranks(
        _phases_body, 1, args=(hf_model, False), timeout_s=300
    )[0]
    cycled, released, params = run_on_ranks(_phases_body, 1, args=(hf_model, True), timeout_s=300)[
        0
    ]
    assert noop["kinds"] == ([], [])  # switched off (CPU default): nothing moves
    assert released["params kept"] > 0  # the sync still needs them
    assert released["params"] == released["grads"] == released["optimizer state"] == 0
    assert released["kinds"] == (
        ["grads", "main params", "optimizer state"],
        ["grads", "main params", "optimizer state", "params"],
    )
    assert released["after onload"] == []
    # bit-exact training; NaN-valued metrics (rollout_is_* without rollout log-probs) compare as equal
    assert [json.dumps(m, sort_keys=True) for m in cycled] == [
        json.dumps(m, sort_keys=True) for m in plain
    ]
    assert all(torch.equal(a, b) for a, b in zip(params, params_plain))
