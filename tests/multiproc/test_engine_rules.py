"""The rules the two learner backends once kept differently, now one rule each, held on both (issue 39).

- A non-finite loss with actor.skip_nonfinite_steps=false raises FloatingPointError with the gradients
  already dropped (the FSDP actor did; the Megatron actor left them in its buffers).
- The reference's parameters must pair with the policy's by name (only the FSDP actor checked).
- Both model managers' optimizer_step answer StepResult(taken, grad_norm, lr) (FSDP's answered
  (grad_norm, [lr per group])).
- A critic offloads only when critic.offload_while_generating says so (the FSDP critic always did).

One rank, the FSDP backend then the Megatron one in the same process, on one tiny Qwen2.
"""

import dataclasses
import math

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model


def _body(path: str, other: str) -> dict:
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        CriticConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.learner.engine_api import StepResult
    from rlmega.fsdp.actor import FSDPActor
    from rlmega.fsdp.critic import FSDPCritic
    from rlmega.megatron.actor import MegatronActor
    from rlmega.megatron.critic import MegatronCritic

    out = {}
    parallel, optim = ParallelismConfig(1, 1, None, 1), OptimizerConfig(lr=1e-3)
    for name, actor_cls, critic_cls in (
        ("fsdp", FSDPActor, FSDPCritic),
        ("megatron", MegatronActor, MegatronCritic),
    ):
        r = out[name] = {}
        actor = actor_cls(
            ModelConfig(path=path),
            parallel,
            optim,
            ActorConfig(skip_nonfinite_steps=False),
            AlgorithmConfig(kl_coef=0.1),
        )
        actor.setup(with_reference=True)
        batch = random_batch(6, seed=3)
        batch = dataclasses.replace(
            batch,
            old_logprobs=actor.compute_logprobs(batch),
            ref_logprobs=actor.compute_ref_logprobs(batch),
        )
        bad = dataclasses.replace(batch, advantages=[a.clone() for a in batch.advantages])
        bad.advantages[0][0] = float("nan")
        try:
            actor.train_step(bad)
            r["raised"] = False
        except FloatingPointError:
            r["raised"] = True
        model = actor.policy.model
        # Megatron: one chunk per virtual stage
        chunks = model if isinstance(model, list) else [model]
        grads = [getattr(p, "main_grad", p.grad) for c in chunks for p in c.parameters()]
        r["grads_dropped"] = all(g is None or not g.any() for g in grads)
        m = actor.train_step(batch)  # and training goes on from clean gradients
        r["next_step"] = (m["skipped"], math.isfinite(m["grad_norm"]), math.isfinite(m["loss"]))
        # a reference built from another model's parameters does not pair with the policy
        stranger = actor.engine_class(
            ModelConfig(path=other), parallel, optim, ActorConfig(), with_optimizer=False
        )
        stranger.build()
        try:
            stranger.param_pairs(actor.policy)
            r["pairs_refused"] = False
        except RuntimeError as e:
            r["pairs_refused"] = "parameters differ" in str(e)
        r["step_result"] = isinstance(actor.policy.optimizer_step(), StepResult)
        del stranger
        actor.teardown()
        for flag in (False, True):  # (each role sets up its process's groups: one at a time here)
            critic = critic_cls(
                ModelConfig(path=path), parallel, optim, CriticConfig(offload_while_generating=flag)
            )
            critic.setup()
            r[f"critic_offloads_{flag}"] = critic.offload_for_rollout()["offloaded"]
            critic.onload_for_training()
            critic.teardown()
    return out


def test_both_backends_keep_one_rule_each(tmp_path):
    path = make_tiny_model(
        tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=1, seed=1
    )
    other = make_tiny_model(
        tmp_path / "o", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, seed=2
    )
    [out] = run_on_ranks(_body, 1, args=(str(path), str(other)), timeout_s=600)
    kinds = {
        "fsdp": ["grads", "optimizer state", "params"],
        "megatron": ["grads", "main params", "optimizer state", "params"],
    }
    for name, r in out.items():
        assert r["raised"] and r["grads_dropped"], (name, r)
        assert r["next_step"] == (0, True, True), (name, r)
        assert r["pairs_refused"] and r["step_result"], (name, r)
        assert r["critic_offloads_False"] == [] and r["critic_offloads_True"] == kinds[name], (
            name,
            r,
        )
