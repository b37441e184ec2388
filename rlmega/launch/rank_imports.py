"""What a trainer rank's process keeps out of its imports, set once as the process starts (a Ray rank host's
``__init__``, a serving torchrun rank's ``serve``): a process-global side effect, at process start only.

wandb: megatron-core imports it whenever it is installed (megatron/core/timers.py and its inference engine's
dynamic_context.py and dynamic_engine.py, each in a ``try: import wandb``), 0.8 s of every rank's start here,
and four ranks of a TP2 x PP2 run start on two cores beside the engine (a TP2 x PP2 run to its second step,
5 interleaved pairs: 1.3 s sooner on average, -3.7 to +0.4 s: noise of this size). A rank never logs to
wandb: the driver does (rundir/run.py; under torchrun, rank 0, which is left alone).
"""

from __future__ import annotations

import sys

NEVER_USED = ("wandb",)


def keep_out_unused() -> None:
    """Make ``import wandb`` raise ImportError in this process (None in sys.modules: Python's own way to say a
    module is not to be imported), which megatron-core's guards take as "not installed". Already imported: left."""
    for name in NEVER_USED:
        sys.modules.setdefault(name, None)
