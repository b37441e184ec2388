"""The sampler's token ranks on CPU engines (rollout/engine_lifecycle.eager_token_ranks): the eager formula the
sampler gets counts exactly what vLLM's own function does, ties and batch sizes 1 and many included.

vLLM's function is run as its source has it, uncompiled (``__wrapped__``, what ``torch.compile`` wraps): its
compilation with inductor took 19 of this test's 20 s, and what it checks, that vLLM's formula is ours (a ``>``
where we have ``>=`` fails here), is the formula's, not the compiler's."""
import torch

from rlmega.rollout.engine_lifecycle import count_at_least, eager_token_ranks


def test_eager_ranks_equal_vllms_and_the_sampler_uses_them(monkeypatch):
    import vllm.v1.sample.sampler as sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    vllms = batched_count_greater_than.__wrapped__  # the function torch.compile wraps (module docstring)

    g = torch.Generator().manual_seed(0)
    for batch in (1, 5):
        logits = torch.randn(batch, 300, generator=g).round(decimals=1)  # rounded: many ties
        logprobs = torch.log_softmax(logits, dim=-1)
        token = torch.randint(0, 300, (batch, 1), generator=g)
        chosen = logprobs.gather(-1, token)
        want = vllms(logprobs, chosen)
        assert torch.equal(count_at_least(logprobs, chosen), want), batch
        assert want.min() >= 1  # the token itself counts: rank 1 is the top
    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)  # put back after
    eager_token_ranks()
    assert sampler.batched_count_greater_than is count_at_least
