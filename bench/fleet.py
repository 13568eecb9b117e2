"""A fleet of Telemetry agent streams in one process, cheap enough that one core drives
5,000 of them at 1 Hz (bench.scale's load generator).

grpc.aio costs the client about as much per report as it costs the replica (a write
and a read through the aio call machinery, a task wake-up per stream and second):
two processes of grpc.aio streams wrote 4,188 of 5,000 reports a second on one core,
and one task per stream (write, read the ack, sleep) used 68 % of the core at 3,000.
This client speaks the same protocol to the same server, gRPC over HTTP/2 on a few
TCP connections, without the per-call machinery: a stream is an HTTP/2 stream
opened with one HEADERS frame, a report is one DATA frame holding a pre-serialised
NodeReport (only seq and sampled_at are appended each second), and one ticker
writes every stream due in each 5 ms slice with one ``transport.write`` per
connection. Acks are parsed as they come in (``data_received``), so the cost per
report is a few dict and bytes operations.

What it does of HTTP/2 (RFC 9113): the connection preface and SETTINGS (with a
large initial window, so the replica's acks never wait for a WINDOW_UPDATE), SETTINGS
and PING acknowledgements, flow control on what it sends (a report that the peer's
windows do not admit is not written, and counted), request headers as HPACK
literals without indexing (response headers are skipped unread: nothing here needs
them, and no HPACK state is kept for them), trailers or RST_STREAM end a stream,
GOAWAY or a closed socket ends a connection. The agent's protocol on top: seq
increases by one per report; a stream that ended is reopened, on the next replica
when its connection is gone, resending from the report after the highest ack (as
tide/services/agent/buffer.py resends what was not acked).
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from collections.abc import Callable
from typing import Any

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_MAX_WINDOW = 2**31 - 1
#: Reports are written in slices of this many seconds: each stream once a second, in
#: the slice of its phase, so the fleet's reports are spread over the second.
SLICE_S = 0.005
_HEAD = struct.Struct(">I")


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + (stream & 0x7FFFFFFF).to_bytes(4, "big")
        + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    # HPACK literal header field without indexing, new name (RFC 7541 6.2.2); every
    # name and value here is shorter than 127 bytes, so a length is one byte.
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class Stream:
    """One agent: its node's report template, sequence state and the HTTP/2 stream
    it currently speaks on."""

    __slots__ = (
        "acked",
        "attempt",
        "conn",
        "high",
        "index",
        "low",
        "retry_at",
        "sent",
        "seq",
        "sid",
    )

    def __init__(self, high: bytes, low: bytes, attempt: int) -> None:
        self.index = attempt
        self.high = high
        self.low = low
        self.attempt = attempt  # which replica: ports[attempt % len(ports)]
        self.conn: Connection | None = None
        self.sid = 0
        self.seq = 0
        self.acked = 0
        self.sent: dict[int, float] = {}  # seq -> perf_counter when written
        self.retry_at = 0.0


class Connection(asyncio.Protocol):
    def __init__(self, fleet: Fleet, authority: bytes) -> None:
        self.fleet = fleet
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.next_sid = 1
        self.streams: dict[int, Stream] = {}
        self.inbuf = bytearray()
        self.partial: dict[int, bytearray] = {}  # a gRPC message split over DATA frames
        self.send_window = 65535  # connection level, raised by the peer's WINDOW_UPDATEs
        self.initial_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.windows: dict[int, int] = {}  # per stream
        self.out = bytearray()
        self.headers_block = b"".join(
            (
                _literal(b":method", b"POST"),
                _literal(b":scheme", b"http"),
                _literal(b":path", b"/tide.v1.Telemetry/Stream"),
                _literal(b":authority", authority),
                _literal(b"content-type", b"application/grpc"),
                _literal(b"te", b"trailers"),
            )
        )

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        settings = struct.pack(">HI", 0x4, _MAX_WINDOW) + struct.pack(">HI", 0x2, 0)
        transport.write(
            _PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW, 0, 0, _HEAD.pack(_MAX_WINDOW - 65535))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._close()

    def data_received(self, data: bytes) -> None:
        buf = self.inbuf
        buf += data
        pos = 0
        n = len(buf)
        while n - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            if n - pos < 9 + length:
                break
            kind = buf[pos + 3]
            flags = buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            if kind == _DATA:
                self._data(sid, payload)
                if flags & _END_STREAM:
                    self._end(sid)
            elif kind == _HEADERS:
                if flags & _END_STREAM:  # trailers (or a trailers-only answer): it ended
                    self._end(sid)
            elif kind == _RST:
                self._end(sid)
            elif kind == _SETTINGS:
                if not flags & _ACK:
                    self._settings(payload)
                    self._send(_frame(_SETTINGS, _ACK, 0, b""))
            elif kind == _PING:
                if not flags & _ACK:
                    self._send(_frame(_PING, _ACK, 0, payload))
            elif kind == _WINDOW:
                inc = _HEAD.unpack(payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.send_window += inc
                elif sid in self.windows:
                    self.windows[sid] += inc
            elif kind == _GOAWAY:
                self._close()
                return
        del buf[:pos]

    # -- frames -------------------------------------------------------------------------

    def _send(self, frame: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(frame)

    def _settings(self, payload: bytes) -> None:
        for off in range(0, len(payload) - 5, 6):
            ident, value = struct.unpack_from(">HI", payload, off)
            if ident == 0x4:
                delta = value - self.initial_window
                self.initial_window = value
                for sid in self.windows:
                    self.windows[sid] += delta

    def _data(self, sid: int, payload: bytes) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        held = self.partial.get(sid)
        if held is not None:
            payload = bytes(held) + payload
            del self.partial[sid]
        pos = 0
        while len(payload) - pos >= 5:
            size = _HEAD.unpack_from(payload, pos + 1)[0]
            if len(payload) - pos - 5 < size:
                break
            self.fleet.on_ack(st, payload[pos + 5 : pos + 5 + size])
            pos += 5 + size
        if pos < len(payload):
            self.partial[sid] = bytearray(payload[pos:])

    def _end(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        self.windows.pop(sid, None)
        self.partial.pop(sid, None)
        if st is not None and st.sid == sid:
            self.fleet.on_end(st)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        for sid in list(self.streams):
            self._end(sid)

    # -- what the fleet's ticker calls --------------------------------------------------

    def open(self, st: Stream) -> None:
        sid = self.next_sid
        self.next_sid += 2
        self.streams[sid] = st
        self.windows[sid] = self.initial_window
        st.conn = self
        st.sid = sid
        self.out += _frame(_HEADERS, _END_HEADERS, sid, self.headers_block)

    def report(self, st: Stream, message: bytes) -> bool:
        """Queue one report on the stream; False when the peer's windows do not admit it."""
        size = len(message) + 5
        sid = st.sid
        if size > self.send_window or size > self.windows[sid]:
            return False
        self.send_window -= size
        self.windows[sid] -= size
        self.out += _frame(_DATA, 0, sid, b"\x00" + _HEAD.pack(len(message)) + message)
        return True

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.closed:
            self.transport.write(bytes(self.out))
        self.out.clear()


class Fleet:
    """Streams in one process against ``ports`` (one replica each); ``conns`` TCP
    connections to each replica. ``on_ack_seq`` reads a TelemetryAck's acked_seq."""

    def __init__(
        self,
        ports: list[int],
        templates: list[tuple[bytes, bytes]],
        *,
        conns: int,
        warm_at: float,
        period_s: float,
        acked_seq: Callable[[bytes], int],
        ramp_per_s: int = 1000,
    ) -> None:
        self.ramp_per_s = max(1, ramp_per_s)
        self.ports = ports
        self.conns_per_port = conns
        self.streams = [Stream(h, lo, i) for i, (h, lo) in enumerate(templates)]
        self.warm_at = warm_at
        self.period_s = period_s
        self.acked_seq = acked_seq
        self.conns: dict[int, list[Connection]] = {}
        self.lat: list[tuple[float, float]] = []  # (written at, perf_counter; latency)
        self.errors = 0  # streams that ended (reconnected) during the run
        self.written = 0  # reports written after the warm-up
        self.refused = 0  # reports the peer's flow-control windows did not admit
        self.ending = False

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        for port in self.ports:
            out: list[Connection] = []
            self.conns[port] = out
            authority = f"127.0.0.1:{port}".encode()
            for _ in range(self.conns_per_port):
                _, proto = await loop.create_connection(
                    functools.partial(Connection, self, authority), "127.0.0.1", port
                )
                out.append(proto)

    def on_ack(self, st: Stream, message: bytes) -> None:
        n = self.acked_seq(message)
        if n <= st.acked:
            return
        st.acked = n
        now = time.perf_counter()
        sent = st.sent
        for s in [s for s in sent if s <= n]:
            t = sent.pop(s)
            if t > self.warm_at:
                self.lat.append((t, now - t))

    def on_end(self, st: Stream) -> None:
        st.conn = None
        st.sid = 0
        st.sent.clear()  # resent on the next stream: timed again from there
        if not self.ending:
            self.errors += 1
            st.attempt += 1  # the next replica behind the Service
            st.retry_at = time.monotonic() + 0.2

    def _conn_for(self, st: Stream) -> Connection | None:
        for k in range(len(self.ports)):
            port = self.ports[(st.attempt + k) % len(self.ports)]
            live = [c for c in self.conns[port] if not c.closed]
            if live:
                st.attempt += k
                return live[st.index % len(live)]
        return None

    async def run(self, seconds: float) -> None:
        """Each stream reports once a second, in the slice of its phase, for ``seconds``."""
        slices = round(1.0 / SLICE_S)
        by_slice: list[list[Stream]] = [[] for _ in range(slices)]
        for i, st in enumerate(self.streams):
            by_slice[i * slices // max(1, len(self.streams)) % slices].append(st)
        start = time.monotonic()
        # Streams open at ramp_per_s a second, not all in the first second: a gRPC
        # server takes one new call per event-loop turn, and a call it has not taken
        # within 30 s (grpc.server_max_unrequested_time_in_server) it cancels.
        for i, st in enumerate(self.streams):
            st.retry_at = start + i // self.ramp_per_s
        end = start + seconds
        k = 0
        live: set[Connection] = set()
        while True:
            at = start + k * SLICE_S
            if at >= end:
                break
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            wall = time.time()
            sec = int(wall)
            ts = b"\x08" + varint(sec) + b"\x10" + varint(int((wall - sec) * 1e9))
            tail = b"\x22" + varint(len(ts)) + ts
            high = int(wall / self.period_s) % 2 == 0
            now = time.perf_counter()
            mono = time.monotonic()
            for st in by_slice[k % slices]:
                conn = st.conn
                if conn is None or conn.closed:
                    if mono < st.retry_at:
                        continue
                    conn = self._conn_for(st)
                    if conn is None:
                        continue
                    conn.open(st)
                    st.seq = st.acked  # resend from the report after the highest ack
                seq = st.seq + 1
                msg = (st.high if high else st.low) + b"\x18" + varint(seq) + tail
                if not conn.report(st, msg):
                    self.refused += 1
                    continue
                st.seq = seq
                st.sent[seq] = now
                if now > self.warm_at:
                    self.written += 1
                live.add(conn)
            for conn in live:
                conn.flush()
            live.clear()
            k += 1

    async def close(self) -> None:
        self.ending = True
        # Half-close every stream (END_STREAM on an empty DATA frame), as an agent
        # that stops does, then give the acks in flight a moment.
        for conns in self.conns.values():
            for conn in conns:
                for sid in list(conn.streams):
                    conn.out += _frame(_DATA, _END_STREAM, sid, b"")
                conn.flush()
        await asyncio.sleep(0.5)
        for conns in self.conns.values():
            for conn in conns:
                conn._close()


def run_fleet(
    ports: list[int],
    templates: list[tuple[bytes, bytes]],
    seconds: float,
    warm_s: float,
    conns: int,
    period_s: float,
    ramp_per_s: int = 1000,
) -> dict[str, Any]:
    """Run the fleet for ``seconds``; its figures, with the process's CPU per wall second."""
    from tide.v1 import telemetry_pb2

    parse = telemetry_pb2.TelemetryAck.FromString

    async def main() -> dict[str, Any]:
        fleet = Fleet(
            ports,
            templates,
            conns=conns,
            warm_at=time.perf_counter() + warm_s,
            period_s=period_s,
            acked_seq=lambda b: parse(b).acked_seq,
            ramp_per_s=ramp_per_s,
        )
        await fleet.connect()
        cpu0, t0 = time.process_time(), time.monotonic()
        await fleet.run(seconds)
        cpu = (time.process_time() - cpu0) / max(1e-9, time.monotonic() - t0)
        await fleet.close()
        return {
            "lat": fleet.lat,
            "errors": fleet.errors,
            "written": fleet.written,
            "refused": fleet.refused,
            "cpu": cpu,
        }

    return asyncio.run(main())
