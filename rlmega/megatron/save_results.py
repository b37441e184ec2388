"""Megatron's checkpoint writer hands back its results in-process: no Manager process to outlive a rank.

megatron-core 0.16.1's writer for the torch_dist save strategy (``FileSystemWriterAsync``) passes each
save's write results through ``filesystem_async._get_write_results_queue()``, which on first use starts
``multiprocessing.get_context("spawn").Manager()``: a ~300 MB server process, plus multiprocessing's
resource tracker, per rank. A rank that exits normally shuts them down; a rank killed with SIGKILL (a
kill -9 of the driver that takes Ray's raylet with it, torchrun tearing a job down) leaves both
re-parented to init for good.

rlmega saves synchronously (``dist_checkpointing.save`` without ``async_sharded_save``): Megatron runs
the writer's function in the rank's own process (``AsyncRequest.execute_sync``), where it puts its
results, and the finalize step takes them in that same process. A plain thread-safe queue carries them
just as well, so ``use_in_process_queue()`` installs one before the first save and no Manager starts.
An async save (results put by a separate writer process) would need a cross-process queue again.
"""

from __future__ import annotations

import queue
import warnings

from megatron.core.dist_checkpointing.strategies import filesystem_async


def use_in_process_queue() -> None:
    """Make Megatron's save results travel through an in-process queue (idempotent; call before a save)."""
    if not hasattr(filesystem_async, "_results_queue"):
        # A megatron-core other than the pinned one: saving still works, with its Manager process.
        warnings.warn(
            "megatron-core's filesystem_async has no _results_queue: its checkpoint writer may start a "
            "Manager process that outlives a rank killed with SIGKILL (rlmega/megatron/save_results.py)",
            stacklevel=2,
        )
        return
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
