"""The packing check a model of a family outside rlmega's table (rlmega/config/families.py) must pass
before the FSDP learner trains it (``model.allow_untested_family: true``).

    err = family_check.check_packing(model, vocab_size=V, dtype="float32")   # every rank, same call

Two short random sequences run packed into one row (position ids restarting, as the learner packs) and
each alone; their logits must agree to the dtype's floor. A family whose attention bypasses
transformers' attention interface (so it sees the packed row as one sequence), or whose recurrent state
runs from one sequence into the next, fails by orders of magnitude more, and is refused here, naming
its architecture, before any step trains on it.
"""

from __future__ import annotations

import torch

LENGTHS = (13, 9)
# Measured on the table's families' tiny models (tests/unit/test_families.py): float32 <= 8.4e-7, bfloat16 0 (each
# sequence's arithmetic is the same packed or alone); the state of a tiny Qwen3-Next leaking across sequences
# (without rlmega's restart) 5.9e-2 in float32 and 5.2e-2 in bfloat16.
LIMITS = {"float32": 1e-4, "bfloat16": 1e-2}


class PackingError(RuntimeError):
    pass


@torch.no_grad()
def check_packing(model: torch.nn.Module, vocab_size: int, dtype: str) -> float:
    """Max abs logit difference between the packed row and each sequence alone; PackingError above the
    limit for ``dtype``. The model is run in eval mode (no dropout) and put back as it was."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (1, n), generator=g) for n in LENGTHS]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        packed = model(
            input_ids=torch.cat(seqs, 1).to(device),
            position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device),
            use_cache=False,
        ).logits.float()
        alone = torch.cat(
            [
                model(
                    input_ids=s.to(device),
                    position_ids=torch.arange(s.shape[1])[None].to(device),
                    use_cache=False,
                ).logits.float()
                for s in seqs
            ],
            dim=1,
        )
    finally:
        model.train(was_training)
    err = (packed - alone).abs().max().item()
    if not err <= LIMITS[dtype]:
        arch = (getattr(model.config, "architectures", None) or [model.config.model_type])[0]
        raise PackingError(
            f"{arch}: a packed row of two sequences gives logits {err:.3g} away from each sequence "
            f"alone (limit {LIMITS[dtype]:g} in {dtype}): its attention or recurrent layers mix "
            "packed sequences, so training would use wrong log-probs. This family cannot train on "
            "the FSDP learner until rlmega supports it (rlmega/config/families.py)"
        )
    return err
