"""gRPC channel and server options, chosen together so both ends agree.

Keepalive is configured on both sides at once: gRPC's server by default
expects at least 5 min between pings without data and, after two such "ping
strikes", sends GOAWAY(too_many_pings), so a client that pings more often than
the server permits loses its stream (grpc/grpc doc/keepalive.md). So the server's minimum ping
interval is derived from the client's keepalive time, never set on its own.
"""

from __future__ import annotations

from typing import Any

#: Largest message either side accepts, bytes. A NodeReport of 8 GPUs is about
#: 400 B; 4 MiB leaves room for hundreds of GPUs and large history pages while
#: bounding what one bad peer can make us allocate.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024

#: A client (agent, launcher, CLI) pings an idle connection this often, seconds.
#: Short enough to notice a stalled network path well within the scaler's
#: staleness limit; far above what a loaded server notices as abuse.
KEEPALIVE_TIME_S = 20.0

#: A ping not answered within this many seconds marks the connection dead.
KEEPALIVE_TIMEOUT_S = 10.0

#: Default deadline of a unary client call, seconds. Streams use none; they
#: rely on keepalive to notice a dead peer.
DEFAULT_TIMEOUT_S = 5.0


def client_options(
    *,
    keepalive_time_s: float = KEEPALIVE_TIME_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        # grpcio 1.85 times a keepalive ping out after http2.ping_timeout_ms
        # (default 60 s); keepalive_timeout_ms alone did not shorten it.
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
        # Agents hold a stream open but may be idle between reports.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a scaler restart; backoff above this is ours.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]


def server_options(
    *,
    client_keepalive_time_s: float = KEEPALIVE_TIME_S,
    keepalive_time_s: float = 30.0,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> list[tuple[str, Any]]:
    # Permit pings at half the client's period so jitter never counts as a strike.
    min_ping_ms = max(1, int(client_keepalive_time_s * 1000 / 2))
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # The server also pings, so a vanished agent's stream is reaped.
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", min_ping_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]
