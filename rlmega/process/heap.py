"""A process's start-up imports without the garbage collector, and what they built frozen after.

    with imports_uncollected():        # a rank host's backend, an engine's vLLM, the driver's stack
        import heavy_stack
    # collections are back on, and skip every object the block (and anything before it) left alive

Why: importing torch, transformers, vLLM, megatron-core and Ray builds a heap of ~600,000 tracked objects, and
as it grows the collector runs on thresholds, ~1,600 young and 9 full collections over that one import here,
each full one walking the whole heap (0.55 s at the end). Module objects live as long as the process and hold
few cycles, so those walks find next to nothing: the same imports took 7.1 s with the collector off against
9.5 s with it on (and 8.5 / 17.3 s under load). After the block, ``gc.freeze`` moves the survivors to the
permanent generation, which later collections skip, as vLLM does for its engine core once it has started
(vllm/utils/gc_utils.freeze_gc_heap). A cycle among frozen objects that becomes garbage later is never
collected: only import-time objects (modules, classes, functions and what they hold) are frozen here, never a
model's tensors or a step's data.

Called where a process starts its role (process-global, at process start only): the ``rlmega`` console
script before a subcommand's stack (rlmega/cli.py entry), ``python -m rlmega.train`` (torchrun's ranks
too) before its module's imports (rlmega/train.py), a trainer rank before it imports its backend (a Ray rank
host, launch/worker_group.py; a torchrun rank, launch/torchrun_group.py), and a rollout engine's worker before it
imports vLLM (rollout/rollout.py).
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def imports_uncollected(freeze: bool = True):
    """The collector off for the block, then (``freeze``) everything alive frozen, and the collector as it was
    before. ``freeze`` False: a rollout engine's worker, which freezes its heap only for the fork of its core
    (rollout/engine_lifecycle.forked_engine_core) and thaws it after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        settle(enabled, freeze)


def settle(enable: bool = True, freeze: bool = True) -> None:
    """The end of a start's imports begun with ``gc.disable()`` (where no block can hold them, as a module run
    with ``python -m``): everything alive frozen (``freeze``), then the collector on (``enable``)."""
    if freeze:
        gc.freeze()
    if enable:
        gc.enable()
