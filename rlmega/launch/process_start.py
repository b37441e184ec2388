"""The process-global settings rlmega makes, each once, as a process starts; nothing else in rlmega changes
interpreter-wide state.

- ``keep_out_unused()``: a trainer rank's process (a Ray rank host's ``__init__``, a serving torchrun rank's
  ``serve``) keeps wandb out of its imports. megatron-core imports it whenever it is installed
  (megatron/core/timers.py and its inference engine's dynamic_context.py and dynamic_engine.py, each in a
  ``try: import wandb``), 0.8 s of every rank's start here, and four ranks of a TP2 x PP2 run start on two cores
  beside the engine (a TP2 x PP2 run to its second step, 5 interleaved pairs: 1.3 s sooner on average, -3.7 to
  +0.4 s: noise of this size). A rank never logs to wandb: the driver does (rundir/run.py; under torchrun,
  rank 0, which is left alone).
- ``exit_without_collecting()``: a command (``rlmega ...``, ``python -m rlmega.train``) leaves without Python's
  last garbage collections. With torch and transformers loaded, the interpreter's shutdown spent over a second in
  them (``from transformers import AutoTokenizer`` alone: 1.17 s from the last print to the exit, 0.20 s frozen; a
  world-1 `rlmega train`, from "done" to its exit, 2 interleaved pairs: 1.52 and 1.63 s before, 0.32 and 0.25 s
  frozen; a torchrun rank pays it too). Everything a run writes is written, flushed and closed before then
  (rundir/run.py); objects are still freed by reference counting, and the atexit handlers still run.
"""
from __future__ import annotations

import atexit
import gc
import sys

NEVER_USED = ("wandb",)


def keep_out_unused() -> None:
    """Make ``import wandb`` raise ImportError in this process (None in sys.modules: Python's own way to say a
    module is not to be imported), which megatron-core's guards take as "not installed". Already imported: left."""
    for name in NEVER_USED:
        sys.modules.setdefault(name, None)


def exit_without_collecting() -> None:
    """At exit, move every object to gc's permanent generation (``gc.freeze``) before the interpreter shuts
    down, so that its final collections skip them. Registered once; it runs before the atexit handlers
    registered earlier (logging's flush among them), after those registered later (Ray's)."""
    if not getattr(exit_without_collecting, "registered", False):
        atexit.register(gc.freeze)
        exit_without_collecting.registered = True
