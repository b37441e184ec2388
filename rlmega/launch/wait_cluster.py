"""Wait until a Ray cluster has all its nodes: ``python -m rlmega.launch.wait_cluster ADDRESS HOST...``.

tools/slurm/rlmega.sbatch runs it after starting Ray on every node of the allocation and before the
trainer: placement groups ask for every node at once, so a trainer started while a node is still
joining waits on it, then fails with a message about resources rather than about that node. Exits 0
when as many nodes as HOSTs are alive, 1 naming the missing hosts after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time


def missing_hosts(expected: list[str], joined: list[str]) -> list[str]:
    """Expected hosts with no live Ray node (short names compared: Slurm and Ray may differ in domain)."""
    have = {h.split(".")[0] for h in joined}
    return [h for h in expected if h.split(".")[0] not in have]


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rlmega.launch.wait_cluster", description=__doc__.splitlines()[0]
    )
    p.add_argument("address", help="HEAD_IP:PORT of the Ray head")
    p.add_argument(
        "hosts", nargs="+", help="every host that runs a Ray node (scontrol show hostnames)"
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait in all (default 300)"
    )
    args = p.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    joined: list[str] = []
    while time.monotonic() < deadline:
        if not ray.is_initialized():
            # the head is still starting: ray.init would block ~20 s on it
            if not _listening(args.address):
                time.sleep(1)
                continue
            try:
                ray.init(address=args.address, log_to_driver=False, logging_level=logging.ERROR)
            except ray.exceptions.AuthenticationError as e:
                print(
                    f"wait_cluster: {e}\nFix: give every node and the trainer the same RAY_AUTH_MODE=token and "
                    "RAY_AUTH_TOKEN (rlmega.sbatch exports both)",
                    file=sys.stderr,
                )
                return 1
            except (ConnectionError, RuntimeError):
                time.sleep(2)
                continue
        joined = [n["NodeManagerHostname"] for n in ray.nodes() if n["Alive"]]
        if len(joined) >= len(args.hosts):
            print(
                f"wait_cluster: all {len(joined)} Ray nodes joined ({', '.join(sorted(joined))})",
                flush=True,
            )
            return 0
        time.sleep(2)
    gone = missing_hosts(args.hosts, joined) or ["(names differ; compare the lists)"]
    print(
        f"wait_cluster: after {args.timeout:.0f}s {len(joined)} of {len(args.hosts)} Ray nodes joined "
        f"{args.address} (joined: {', '.join(sorted(joined)) or 'none'}; missing: {', '.join(gone)}). "
        "Fix: read the `ray start` lines for those hosts in the job output (a port in use, a firewall "
        "between nodes, a wrong RLMEGA_HEAD_IP), or raise RLMEGA_WAIT_NODES_S",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
