"""The end of a refused request stream: read and drop what the client still sends until
it half-closes, bounded, then the caller aborts with its code.

grpcio's asyncio client loses the status of a call that ends while one of its writes is
in flight: the failed write replaces the server's status with INTERNAL "Internal error
from Core" (grpc/grpc#36066; up to 1 in 100 of the hostile suite's forged streams, 4 to
8 in 10 when the client writes 8 reports). A call ended after the client's half-close
has no write in flight, so that client always reads the refusal's code. One that keeps
writing is refused at a bound all the same, and may still read INTERNAL
(docs/security.md).

The bounds are what a refused caller, often one with no credentials, may cost: a drain
holds the stream's slot among the server's streams (the concurrency limit sits outside
the guard), so at most ``MAX_CONCURRENT`` streams drain at once and the rest are refused
at once; each drain parses at most ``MAX_MESSAGES`` messages, for at most
``LIMIT_S``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import grpc

#: The longest a refused request stream is read (and dropped) before its refusal.
LIMIT_S = 1.0
#: The most messages a drain reads: an agent's burst of held reports, not a flood.
MAX_MESSAGES = 16
#: The most streams draining at once in a process; past it, refused at once.
MAX_CONCURRENT = 32

_draining = 0

#: How the drains of this process ended: "half-close", "max-messages", "limit" (LIMIT_S),
#: "busy" (MAX_CONCURRENT draining, none read), "error <type>". Only the half-close leaves no
#: write in flight; the hostile suite prints these with a refusal that read INTERNAL.
ENDS: collections.Counter[str] = collections.Counter()


async def drain(context: Any) -> None:
    """Read and drop what the refused stream of ``context`` still sends, until the
    client half-closes, within the bounds above; the caller then ends the call.
    Nothing read here reaches a servicer: ``context.read()``, not the guard's
    iterator, which would check it."""
    global _draining
    if _draining >= MAX_CONCURRENT:
        ENDS["busy"] += 1
        return
    _draining += 1
    try:
        async with asyncio.timeout(LIMIT_S):
            for _ in range(MAX_MESSAGES):
                if await context.read() is grpc.aio.EOF:
                    ENDS["half-close"] += 1
                    return
        ENDS["max-messages"] += 1
    except TimeoutError:
        ENDS["limit"] += 1
    except Exception as exc:
        # The client gone, or a read that failed: either way, refuse now. CancelledError
        # is not an Exception: a cancelled handler stays cancelled.
        ENDS[f"error {type(exc).__name__}"] += 1
    finally:
        _draining -= 1
