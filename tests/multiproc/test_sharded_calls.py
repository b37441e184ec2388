"""A batch planned once by the driver, each data-parallel rank given only its Shard, gives exactly the numbers of
every rank given the whole batch (issue 39: the driver's path against the one tests and tools use).

Two ranks (data parallel 2) on each backend: log-probs, a train step (its metrics and the log-probs after it),
an on-policy train step's old log-probs, the critic's values. Two launches from the same seeded weights, one
per path, compared exactly.
"""

import dataclasses
import math

import torch

from rlmega.testing.batches import random_batch
from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model


def _body(path: str, sharded: bool) -> dict:
    import torch.distributed as dist

    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        CriticConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.data.shards import plan_step
    from rlmega.fsdp.actor import FSDPActor
    from rlmega.fsdp.critic import FSDPCritic
    from rlmega.megatron.actor import MegatronActor
    from rlmega.megatron.critic import MegatronCritic

    from rlmega.launch.sharded import merge
    from rlmega.megatron.runtime import teardown_megatron

    def call(obj, method, b, *args, **kwargs):
        """The driver's path (this rank's share, the shares' results put back in batch order), or the whole."""
        if not sharded:
            return getattr(obj, method)(b, *args, **kwargs)
        layout, dp_rank = obj.data_layout()
        plan = plan_step(b.lengths(), layout)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, getattr(obj, method)(plan.shard(b, dp_rank), *args, **kwargs))
        return merge(plan, parts)

    parallel, optim = ParallelismConfig(1, 1, None, 2), OptimizerConfig(lr=1e-3)
    out = {}
    for name, actor_cls, critic_cls in (
        ("fsdp", FSDPActor, FSDPCritic),
        ("megatron", MegatronActor, MegatronCritic),
    ):
        actor = actor_cls(
            ModelConfig(path=path),
            parallel,
            optim,
            ActorConfig(max_tokens_per_micro_batch=40),
            AlgorithmConfig(),
        )
        actor.setup(with_reference=False)
        batch = random_batch(7, seed=5)
        g = torch.Generator().manual_seed(0)  # advantages of both signs: the steps move the weights
        batch = dataclasses.replace(
            batch, advantages=[torch.randn(len(a), generator=g) for a in batch.advantages]
        )
        r = out[name] = {}
        r["lp0"] = call(actor, "compute_logprobs", batch)
        r["m1"] = call(actor, "train_step", dataclasses.replace(batch, old_logprobs=r["lp0"]))
        r["lp1"] = call(actor, "compute_logprobs", batch)
        r["m2"] = call(actor, "train_step", batch, optimizer_steps_per_rl_step=1)
        # the roles share this process's group here (a run gives each its own processes): only Megatron's
        # model-parallel state is set up again
        teardown_megatron(destroy_process_group=False)
        critic = critic_cls(
            ModelConfig(path=path), parallel, optim, CriticConfig(), max_tokens_per_micro_batch=40
        )
        critic.setup()
        r["v0"] = call(critic, "compute_values", batch)
        r["c1"] = call(
            critic, "train_step", dataclasses.replace(batch, returns=[v + 1.0 for v in r["v0"]])
        )
        r["v1"] = call(critic, "compute_values", batch)
        teardown_megatron(destroy_process_group=False)
    return out


def test_shards_give_exactly_the_whole_batchs_numbers(tmp_path):
    path = str(
        make_tiny_model(
            tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, seed=3
        )
    )
    whole = run_on_ranks(_body, 2, args=(path, False), timeout_s=600)
    parts = run_on_ranks(_body, 2, args=(path, True), timeout_s=600)
    for name in ("fsdp", "megatron"):
        w, p = whole[0][name], parts[0][name]
        for key in ("lp0", "lp1", "v0", "v1"):
            assert len(w[key]) == 7 and all(torch.equal(a, b) for a, b in zip(w[key], p[key])), (
                name,
                key,
            )
        for key in ("m1", "m2", "c1"):
            a, b = dict(w[key]), dict(p[key])
            old_a, old_b = a.pop("old_logprobs", None), b.pop("old_logprobs", None)
            differ = {
                k: (a[k], b.get(k))
                for k in a.keys() | b.keys()
                if a.get(k) != b.get(k)
                and not (math.isnan(a.get(k, 0)) and math.isnan(b.get(k, 0)))
            }
            assert not differ and a.get("grad_norm", a.get("critic/grad_norm")) > 0, (
                name,
                key,
                differ,
            )
            if old_a is not None:
                assert all(torch.equal(x, y) for x, y in zip(old_a, old_b)), (name, key)
        assert "old_logprobs" in w["m2"] and len(p["m2"]["old_logprobs"]) == 7
