"""torchrun, with its key-value stores listening only on the address the trainer group uses.

    python -m rlmega.launch.torchrun --standalone --nproc-per-node 4 -m rlmega.train CONFIG [key=value ...]
    python -m rlmega.launch.torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD_ADDRESS:29500 --local-addr THIS_NODE_ADDRESS -m rlmega.train CONFIG ...

The arguments are torchrun's. Plain torchrun's agent hosts two TCPStores (the rendezvous store and the
store the ranks share, MASTER_ADDR:MASTER_PORT) listening on every interface with no authentication;
they carry pickles (rendezvous state, torchrun_group.py's commands), so whoever reaches them runs code
in the job. Here every store server listens on its host's address only (rlmega/process/bound_store.py): on one
node (``--standalone`` or ``--nnodes 1``) that is 127.0.0.1 and nothing is reachable from outside. A
run that spans nodes must expose the stores to its nodes: they listen on the rendezvous endpoint's
and rank 0's node addresses, still without auth, so keep such a run inside a trusted network.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

from rlmega.process.bound_store import BOUND_ENV, BoundTCPStore


def bind_stores(spans_nodes: bool) -> None:
    """Make every TCPStore server this process starts a BoundTCPStore (torchrun's modules look the
    class up by these names when they create their stores)."""
    BoundTCPStore.refuse_loopback = spans_nodes
    # (a class where torch has one: the type checker calls that assigning to a type)
    dist.TCPStore = BoundTCPStore  # type: ignore[misc]  # dynamic_rendezvous, elastic.utils.distributed use it
    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # type: ignore[misc]
    static_tcp_rendezvous.TCPStore = BoundTCPStore  # type: ignore[misc]


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    one_node = args.standalone or torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    if one_node and not args.local_addr:
        # MASTER_ADDR, where the ranks' shared store listens; torch would use this machine's name
        args.local_addr = "127.0.0.1"
    bind_stores(spans_nodes=not one_node)
    os.environ[BOUND_ENV] = "1"  # the ranks inherit it: rank 0 warns when started by plain torchrun
    torchrun.run(args)


if __name__ == "__main__":
    main()
