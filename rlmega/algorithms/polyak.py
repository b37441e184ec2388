"""The reference policy's Polyak update, in float32 whatever the parameters' dtype (both backends)."""

from __future__ import annotations

import torch


@torch.no_grad()
def blend(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    rate: float,
    masters: list | None,
    host: bool = False,
) -> list:
    """ref <- (1 - rate) * ref + rate * policy for each (ref, policy) parameter pair; returns ``masters``.

    The blend runs in float32. In bf16 (8 significant bits) a step of rate * (policy - ref) below half
    a unit in the last place rounds back to ref, so an in-place bf16 blend would leave the reference
    where it is for good (1% of 1.0 -> 1.05 is 5e-4, under bf16's 3.9e-3 there). ``masters`` (None the
    first time: built from the reference) holds one float32 copy per low-precision reference tensor
    (None for float32 ones, blended in place); the reference is that copy rounded once per update.
    ``host``: the masters live in host memory (pinned on CUDA machines), as an offloaded reference does.
    Pass the same list back each update; start again from None whenever the reference is replaced.
    """
    if masters is None:
        pin = host and torch.cuda.is_available()

        def master_of(r: torch.Tensor) -> torch.Tensor | None:
            if r.dtype == torch.float32:
                return None
            m = r.detach().to("cpu" if host else r.device, torch.float32, copy=True)
            return m.pin_memory() if pin else m

        masters = [master_of(r) for r, _ in pairs]
    for (r, p), master in zip(pairs, masters):
        if master is None:  # float32 parameters: the blend in place is the float32 blend
            r.mul_(1.0 - rate).add_(p, alpha=rate)
            continue
        m = master.to(r.device, non_blocking=True)  # the same tensor when it lives on the device
        m.mul_(1.0 - rate).add_(p.float(), alpha=rate)
        r.copy_(m)  # one rounding to the parameter dtype
        if m is not master:
            master.copy_(m)
    return masters
