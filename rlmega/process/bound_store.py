"""torch's TCPStore, with its server listening on the one address its clients use, not on all interfaces.

A TCPStore server binds ``::`` (every interface, IPv4 and IPv6) whatever host name it is given, and
has no authentication; whoever reaches the port reads and writes every key. The trainer group's
stores carry pickles (torchrun_group.py's command channel, torchrun's rendezvous state), so a
reachable store runs code on every rank. ``BoundTCPStore`` hands the server a socket already
listening on ``bind_address(host_name)``: 127.0.0.1 for a one-node group whose ranks connect to
127.0.0.1, the node's own address for a group that spans nodes.

Used by ``rlmega.process.distributed.init_distributed`` (the store of a group rlmega starts: Ray-hosted
ranks, tests, tools) and by ``rlmega.launch.torchrun`` (torchrun's own stores). ``reserve_port`` holds rank
0's port from the moment the launcher asks for it until that store listens on it; ``adopt_listening`` takes a
socket another process already made listen (the test harness's ranks).
"""

from __future__ import annotations

import errno
import ipaddress
import socket

from torch.distributed import TCPStore

# Set by rlmega.launch.torchrun for the ranks it starts: their agent's stores are bound
# (torchrun_group warns otherwise).
BOUND_ENV = "RLMEGA_TORCHRUN_STORES_BOUND"


def bind_address(host: str) -> tuple[int, str]:
    """(address family, address) a server for ``host`` listens on: what ``host`` resolves to here,
    IPv4 first (a loopback name may list ::1 first; clients try every address in turn)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    if not infos:
        raise RuntimeError(f"cannot resolve {host!r} to an address to listen on")
    family, _, _, _, sockaddr = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    return family, sockaddr[0]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


# Ports this process holds for a store it will serve (reserve_port), until BoundTCPStore listens on one.
_reserved: dict[int, socket.socket] = {}


def reserve_port() -> int:
    """A free port of this machine, held by this process (a bound socket, not listening) until a
    ``BoundTCPStore`` of this process serves it. Why: a port found free and let go is anyone's until the
    store binds it, seconds later while the rank imports and builds its model; on a busy machine another
    process took it (EADDRINUSE in rank 0's store, CI of 2026-12-04 with two runs at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))  # every interface: nothing else binds this port meanwhile, on any address
    port = sock.getsockname()[1]
    _reserved[port] = sock
    return port


# Sockets already listening that another process handed this one for its store (adopt_listening): the
# test harness's rank 0 gets its port this way, so nothing can take it between the parent's choice and the
# rank's store (rlmega.testing.multiproc).
_adopted: dict[int, socket.socket] = {}


def adopt_listening(sock: socket.socket) -> int:
    """Keep ``sock`` (listening) for this process's store on its port; return that port."""
    port = sock.getsockname()[1]
    _adopted[port] = sock
    return port


def _release(port: int) -> None:
    """Let go of a port reserve_port holds, right before this process listens on it."""
    sock = _reserved.pop(port, None)
    if sock is not None:
        sock.close()


class PortInUse(RuntimeError):
    """torch's message for the same case ("Address already in use"): its launchers retry on it."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s address only, at ``port`` (0: a free one)."""
    family, address = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse("Address already in use") from e
        raise
    return sock


class BoundTCPStore(TCPStore):
    """``TCPStore`` whose server (``is_master=True``) listens on ``host_name``'s address only.

    ``refuse_loopback``: a group that spans nodes sets it (rlmega.launch.torchrun), so that a host name
    resolving to loopback here (Debian maps the machine's own name to 127.0.1.1) fails with a fix
    instead of a store the other nodes cannot reach.
    """

    refuse_loopback = False

    def __init__(
        self,
        host_name: str,
        port: int,
        *args,
        is_master: bool = False,
        master_listen_fd=None,
        **kwargs,
    ):
        sock = None
        if is_master and master_listen_fd is None and port in _adopted:
            sock = _adopted.pop(port)
        elif is_master and master_listen_fd is None:
            _release(port)  # reserved by this process for this store (reserve_port): now it listens
            try:
                sock = listening_socket(host_name, port)
            except PortInUse:
                # The port is taken: by a multi-tenant store of this process, whose server torch reuses
                # (no new socket), or by another process, which torch reports as it always has.
                pass
        if sock is not None:
            address, port = sock.getsockname()[:2]
            if self.refuse_loopback and is_loopback(address):
                sock.close()
                raise RuntimeError(
                    f"the store for a group that spans nodes would listen on {address} ({host_name!r} resolves to "
                    "loopback on this node), which the other nodes cannot reach. Fix: pass this node's network "
                    "address, e.g. --rdzv-endpoint ADDRESS:PORT and --local-addr ADDRESS"
                )
            master_listen_fd = sock.detach()  # the store's server owns the socket from here on
        super().__init__(
            host_name, port, *args, is_master=is_master, master_listen_fd=master_listen_fd, **kwargs
        )
