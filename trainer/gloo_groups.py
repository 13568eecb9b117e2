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


def _own_store(default_store: Any, rank: int, size: int, group_name: str) -> Any:
    """A TCP store for the gloo group ``group_name`` alone, served by its rank 0; its address
    travels through the default store. Called by every member, rank being the group's."""
    from paddle.base import core

    from trainer.distenv import wait_for_port

    key = f"/tide/gloo_store/{group_name}"
    if rank == 0:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        default_store.set(key, f"{host}:{port}".encode())
        own = core.TCPStore(host, port, True, size, _STORE_TIMEOUT_S)
    else:
        address = bytes(default_store.get(key)).decode()
        # Before the client: Paddle's client sleeps 3 s when it connects before the server
        # listens (it did in every grow to dp 2 x sharding 2 here, 1.8 s of its pause).
        wait_for_port(address, _STORE_TIMEOUT_S)
        host, port_text = address.rsplit(":", 1)
        own = core.TCPStore(host, int(port_text), False, size, _STORE_TIMEOUT_S)
    _STORES.append(own)
    logger.debug("gloo group %s of %d ranks forms over its own store", group_name, size)
    return own
