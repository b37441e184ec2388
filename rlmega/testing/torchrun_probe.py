"""A torchrun job that drives TorchrunGroup without Megatron or Ray (tests/multiproc/test_torchrun_group.py).

    python -m torch.distributed.run --standalone --nproc-per-node 3 -m rlmega.testing.torchrun_probe

Rank 0 builds a Probe on every rank, checks that calls return every rank's answer in rank order
(``call_rank0``: rank 0's only, the others send None but run it too), then calls ``fail`` in which
rank 2 raises while rank 0's own share hangs (as it would in a collective waiting for rank 2): the
group must report rank 2 by name at once. Prints one JSON line.
"""

import json
import os
import sys
import time

from rlmega.launch import torchrun_group


class Probe:
    def __init__(self, tag: str):
        self.tag, self.rank, self.calls = tag, int(os.environ["RANK"]), 0

    def whoami(self, x: int) -> tuple:
        self.calls += 1
        return (self.tag, self.rank, x * 10)

    def count(self) -> int:
        return self.calls

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def importable(self, module: str) -> bool:
        try:
            __import__(module)
            return True
        except ImportError:
            return False

    def fail(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"rank {rank} fails on purpose")
        if self.rank == 0:
            time.sleep(600)  # rank 0 stuck, as in a collective with the failed rank


def main() -> int:
    if torchrun_group.rank():
        return torchrun_group.serve()
    group = torchrun_group.TorchrunGroup(
        Probe, torchrun_group.world_size(), ("t",), ray_address=None, timeout_s=60
    )
    out = {"calls": group.call("whoami", 7)}
    out["rank0"] = group.call_rank0("whoami", 8)
    out["rank0_raw"] = group._send(("call_rank0", ("whoami", (9,), {})))  # what each rank sent back
    out["counts"] = group.call("count")  # every rank ran all three
    start = time.monotonic()
    try:
        group.call("fail", 2)
    except torchrun_group.WorkerGroupError as e:
        out.update(
            error=str(e),
            worker=e.worker,
            cause=type(e.cause).__name__,
            traceback="fails on purpose" in e.remote_traceback,
        )
    out["seconds_to_report"] = time.monotonic() - start
    group.shutdown()
    print(json.dumps(out), flush=True)
    os._exit(0)  # rank 0's share still sleeps in its worker thread: leave without joining it


if __name__ == "__main__":
    sys.exit(main())
