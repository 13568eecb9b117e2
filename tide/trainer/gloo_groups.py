"""One gloo context for every process group that spans the whole world, on the CPU.

Paddle 3.3's gloo fails to form a second process group over the same ranks in a world of 3
or more: ``core.ProcessGroupGloo.create`` reads a peer address that no listener owns
("connect [127.0.0.1]:<port>: Connection refused", or a pair TIMEOUT) and the others hang.
Plain Paddle does it without Tide (``python -m bench.gloo_groups``; the rates are in
docs/sharded.md). A fleet job asks for exactly such groups: with the optimizer sharded over
the world, its sharding group and its check group are the world again.

A group whose members are every rank of the world is the default group under another name: it
has the same members in the same order, and a gloo process group runs its collectives one at
a time in the caller's order, so one context can serve both. :func:`share_world_context` makes
every later gloo group of the whole world reuse the default group's context instead of forming
a new one.

A group over a subset of the ranks (fleet's data-parallel and sharding groups when both
degrees are above 1) cannot share it. Formed over the default group's TCP store as Paddle
forms it, such a group failed every try at 4 ranks here (a pair TIMEOUT, or a peer address
"[127.0.0.1]:412" that is no address at all: its rendezvous reads another context's entries).
Formed over a TCP store of its own, it formed in every try: the group's rank 0 starts one on a
free port and publishes its address in the default store under the group's name, the others
read it there. NCCL and the other backends are left alone.

Forming such a group was slow, and nearly all of it was Nagle's algorithm: Paddle's store
client sends a request in several small writes, so each waits for the server's delayed ACK.
:func:`_nodelay` turns it off on this process's connections to the group's store
and to the default one, and the group's store is made without a worker count (Paddle's wait
for it is a loop of such requests inside the constructor; gloo's rendezvous waits for each
member anyway). The figures before and after are in docs/sharded.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

logger = logging.getLogger(__name__)

# Marks the wrapper, so that a second call (a later generation in the same process) does not
# wrap it again.
_SHARED = "_tide_shares_world_context"
# Give up forming a subgroup's store after this long, seconds (Paddle's TCPStore timeout).
_STORE_TIMEOUT_S = 120
# The subgroups' own stores: a TCPStore's server lives as long as its object.
_STORES: list[Any] = []


def share_world_context() -> None:
    """From now on, a gloo group that spans the whole world reuses the default group's
    context. Call it once the default group exists (after ``init_parallel_env``)."""
    import paddle.distributed as dist

    # Paddle's collective module is untyped; its two private names are used as 3.3 has them.
    collective: Any = importlib.import_module("paddle.distributed.collective")

    current = getattr(collective, "_new_process_group_impl", None)
    if current is None or getattr(current, _SHARED, False):
        # Another Paddle than 3.3 forms its groups elsewhere: left as it is.
        return
    original = current

    def new_process_group(
        backend: str, store: Any, rank: int, world_size: int, group_name: str, *args: Any, **kw: Any
    ) -> Any:
        if backend == "gloo" and world_size > 1 and dist.is_initialized():
            default = collective._get_default_group()
            if world_size == default.nranks:
                logger.debug("gloo group %s spans the world: shares its context", group_name)
                return default.process_group
            store = _own_store(store, rank, world_size, group_name)
        return original(backend, store, rank, world_size, group_name, *args, **kw)

    setattr(new_process_group, _SHARED, True)
    collective._new_process_group_impl = new_process_group
    # The default store serves every subgroup's address (_own_store) and fleet's later
    # rendezvous: each of its requests waits a delayed ACK without this (_nodelay).
    master = os.environ.get("PADDLE_MASTER", "")
    if master:
        _nodelay(int(master.rsplit(":", 1)[1]))


def fast_default_store(master: str) -> None:
    """Makes the default group's store (``master``, ``host:port``) before
    ``init_parallel_env`` does, and turns Nagle's algorithm off on this process's connection to
    it (:func:`_nodelay`), so that the default group's rendezvous inside ``init_parallel_env``
    makes its requests at loopback speed: at 3 and 4 ranks it took 0.8 and 1.3 s of every
    resize's pause here, nearly all of it delayed ACKs (docs/sharded.md). Paddle keeps one
    global store per process (``create_or_get_global_tcp_store``, from the same PADDLE_*
    environment), so ``init_parallel_env`` takes this one. Every backend: the store is the
    same TCP store under NCCL."""
    from paddle.base import core

    core.create_or_get_global_tcp_store()
    _nodelay(int(master.rsplit(":", 1)[1]))


def _nodelay(port: int) -> int:
    """Sets TCP_NODELAY on this process's TCP connections to ``port`` (a Paddle TCPStore's)
    and returns how many. Paddle's store client writes a request in several small writes and
    leaves Nagle's algorithm on, so each request waits for the server's delayed ACK
    (docs/sharded.md), and a 2-rank gloo group's rendezvous is a dozen of them. The sockets are Paddle's own (C++),
    reached through /proc/self/fd; elsewhere, or when a socket is gone, it does nothing."""
    done = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            # A duplicate: options set on it are the socket's; closing it leaves Paddle's fd.
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                if (
                    sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and sock.getpeername()[1] == port
                ):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    done += 1
            except OSError:
                continue
    return done


def _own_store(default_store: Any, rank: int, size: int, group_name: str) -> Any:
    """A TCP store for the gloo group ``group_name`` alone, served by its rank 0; its address
    travels through the default store. Called by every member, rank being the group's."""
    from paddle.base import core

    from tide.trainer.distenv import wait_for_port

    key = f"/tide/gloo_store/{group_name}"
    if rank == 0:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        default_store.set(key, f"{host}:{port}".encode())
        own = core.TCPStore(host, port, True, 0, _STORE_TIMEOUT_S)
    else:
        address = bytes(default_store.get(key)).decode()
        # Before the client: Paddle's client sleeps 3 s when it connects before the server
        # listens (it did in every grow to dp 2 x sharding 2 here, 1.8 s of its pause).
        wait_for_port(address, _STORE_TIMEOUT_S)
        host, port_text = address.rsplit(":", 1)
        port = int(port_text)
        own = core.TCPStore(host, port, False, 0, _STORE_TIMEOUT_S)
    # gloo's rendezvous below makes a dozen requests of it (_nodelay).
    _nodelay(port)
    _STORES.append(own)
    logger.debug("gloo group %s of %d ranks forms over its own store", group_name, size)
    return own
