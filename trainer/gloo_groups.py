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
a new one; groups over a subset of the ranks still form their own (fleet's pure-sharding
layout has none: its other groups are single ranks, which need no context). NCCL and the other
backends are left alone.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Marks the wrapper, so that a second call (a later generation in the same process) does not
# wrap it again.
_SHARED = "_tide_shares_world_context"


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
        return original(backend, store, rank, world_size, group_name, *args, **kw)

    setattr(new_process_group, _SHARED, True)
    collective._new_process_group_impl = new_process_group
