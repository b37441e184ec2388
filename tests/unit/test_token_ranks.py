"""What a CPU engine's forked core starts with (rollout/engine_lifecycle.py): the sampler's token ranks
(eager_token_ranks: the eager formula the sampler gets counts exactly what vLLM's own function does, ties and
batch sizes 1 and many included), and a heap inherited frozen (forked_engine_core).

vLLM's function is run as its source has it, uncompiled (``__wrapped__``, what ``torch.compile`` wraps): its
compilation with inductor took 19 of this test's 20 s, and what it checks, that vLLM's formula is ours (a ``>``
where we have ``>=`` fails here), is the formula's, not the compiler's."""

import gc

import torch

from rlmega.rollout.engine_lifecycle import count_at_least, eager_token_ranks, forked_engine_core


def test_eager_ranks_equal_vllms_and_the_sampler_uses_them(monkeypatch):
    import vllm.v1.sample.sampler as sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    # the function torch.compile wraps (module docstring)
    vllms = batched_count_greater_than.__wrapped__

    g = torch.Generator().manual_seed(0)
    for batch in (1, 5):
        logits = torch.randn(batch, 300, generator=g).round(decimals=1)  # rounded: many ties
        logprobs = torch.log_softmax(logits, dim=-1)
        token = torch.randint(0, 300, (batch, 1), generator=g)
        chosen = logprobs.gather(-1, token)
        want = vllms(logprobs, chosen)
        assert torch.equal(count_at_least(logprobs, chosen), want), batch
        assert want.min() >= 1  # the token itself counts: rank 1 is the top
    # put back after
    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)
    eager_token_ranks()
    assert sampler.batched_count_greater_than is count_at_least


def _frozen_in_child(queue) -> None:
    queue.put(gc.get_freeze_count())


def test_the_forked_core_inherits_the_heap_frozen_and_this_process_is_thawed_after():
    """The core's five gc.collect() calls at start walked every object it inherited (3.3 s of an engine start
    here): forked inside forked_engine_core, the child finds them in the permanent generation, which collections
    skip; the parent collects as before once the block ends."""
    import vllm.v1.engine.utils as engine_utils

    with forked_engine_core():
        context = engine_utils.get_mp_context()  # what vLLM starts its core with: fork, here
        queue = context.Queue()
        child = context.Process(target=_frozen_in_child, args=(queue,))
        child.start()
        frozen = queue.get(timeout=60)
        child.join(timeout=60)
    assert context.get_start_method() == "fork"
    # (vLLM, torch and the rest: hundreds of thousands)
    assert frozen > 0.9 * len(gc.get_objects()), frozen
    assert gc.get_freeze_count() == 0
