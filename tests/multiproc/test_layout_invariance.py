"""Megatron layouts are invisible to the math: TP/PP/VPP/DP runs equal the one-process run.

A single-process GPT (TP1 PP1, Llama-shaped, built by MegatronModelManager from an HF config)
makes the weights, saves them with Megatron's dist checkpointing, and records loss and gradient norm
for three optimizer steps on a fixed batch.
Each layout then loads those weights (resharded by dist checkpointing), runs the same batch
through ``get_forward_backward_func()`` + Megatron DDP + the distributed optimizer on 4 real
gloo ranks, and must reproduce the reference within rel 1e-5.

Negative controls: a perturbed shard on one TP rank, and the CPU layer switched off, must fail.
"""

import json
import math

import pytest
import torch

from rlmega.testing.multiproc import RankFailed, run_on_ranks

VOCAB, SEQ, ROWS, MBS, STEPS = 64, 16, 8, 1, 3  # 4 micro-batches a rank: 2 interleaving groups
HF_CONFIG = dict(  # a Llama shape; weights come from the reference run, not from a folder
    architectures=["LlamaForCausalLM"],
    num_hidden_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
REL = 1e-5


def _manager(tp: int, pp: int, vpp):
    import torch.distributed as dist

    from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.model_manager import MegatronModelManager

    mm = MegatronModelManager(
        ModelConfig(),
        ParallelismConfig(tp, pp, vpp, dist.get_world_size()),
        OptimizerConfig(lr=1e-3, clip_grad=1.0),
        hf_config=HF_CONFIG,
    )
    mm.setup_model_and_optimizer(load_weights=False)
    return mm


def _batch() -> torch.Tensor:
    """The global batch: (ROWS, SEQ+1) token ids, same on every rank."""
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _train(mm) -> dict:
    """STEPS optimizer steps on this DP rank's rows; the loss and grad norm of each."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = _batch().chunk(dp)[dp_rank]
    from rlmega.megatron.lm_step import lm_forward_backward

    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(lm_forward_backward(mm.model, rows, MBS))
        ok, grad_norm, _ = mm.optimizer_step()
        assert ok
        norms.append(grad_norm)
    return {"loss": losses, "grad_norm": norms}


def _reference_body(ckpt_dir: str) -> dict:
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    init_megatron(1, 1, None, seed=11)
    mm = _manager(1, 1, None)
    mm.save_checkpoint(ckpt_dir, step=0)
    out = _train(mm)
    teardown_megatron()
    return out


def _layout_body(
    ckpt_dir: str, tp: int, pp: int, vpp, perturb_tp_rank1: bool = False, cpu_layer: bool = True
) -> dict:
    from megatron.core import parallel_state as ps

    from rlmega.megatron import cpu_support
    from rlmega.megatron.runtime import init_megatron, teardown_megatron

    # A different seed than the reference: every weight must come from the checkpoint.
    init_megatron(tp, pp, vpp, seed=99)
    if not cpu_layer:
        cpu_support.disable_cpu_execution()
    mm = _manager(tp, pp, vpp)
    mm.load_checkpoint(ckpt_dir, model_only=True)  # resharded from TP1 PP1 by dist checkpointing
    if perturb_tp_rank1 and ps.get_tensor_model_parallel_rank() == 1:
        with torch.no_grad():  # one shard of one layer's MLP, on one rank only
            mm.unwrapped()[0].decoder.layers[0].mlp.linear_fc1.weight[0].add_(0.05)
    out = _train(mm)
    teardown_megatron()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ref_ckpt")
    (out,) = run_on_ranks(_reference_body, 1, args=(str(ckpt),), timeout_s=240)
    return str(ckpt), out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_matches(got: dict, ref: dict, what: str):
    for key in ("loss", "grad_norm"):
        for step, (g, r) in enumerate(zip(got[key], ref[key])):
            assert _rel(g, r) <= REL, f"{what}: {key} at step {step} = {g!r}, reference {r!r}"


LAYOUTS = {  # (tp, pp, vpp) on 4 ranks; DP fills the rest
    "tp2_pp1_dp2": (2, 1, None),
    "tp1_pp2_dp2": (1, 2, None),
    "tp2_pp2_dp1": (2, 2, None),
    "pp2_vpp2_dp2": (1, 2, 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, name):
    ckpt, ref = reference
    results = run_on_ranks(_layout_body, 4, args=(ckpt, *LAYOUTS[name]), timeout_s=300)
    for rank, got in enumerate(results):  # every rank reports the same global numbers
        _assert_matches(got, ref, f"{name} rank {rank}")
    # The distributed optimizer's steps train: the loss goes down every step.
    losses = results[0]["loss"]
    assert all(math.isfinite(x) for x in losses + results[0]["grad_norm"])
    assert losses[0] > losses[1] > losses[2], losses
    print(name, json.dumps(results[0]))


def test_a_perturbed_shard_is_detected(reference):
    ckpt, ref = reference
    got = run_on_ranks(_layout_body, 4, args=(ckpt, 2, 2, None, True), timeout_s=300)[0]
    with pytest.raises(AssertionError):
        _assert_matches(got, ref, "perturbed")


def test_without_the_cpu_layer_megatron_cannot_run(reference):
    ckpt, _ = reference
    with pytest.raises(RankFailed, match="(?i)cuda"):
        run_on_ranks(
            _layout_body, 2, args=(ckpt, 1, 2, None), kwargs={"cpu_layer": False}, timeout_s=300
        )
