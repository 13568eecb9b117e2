"""The bounded buffer of reports that the scaler has not acknowledged yet.

Two queues, oldest first:

- ``in flight``: reports that were given a sequence number and written to a
  stream at least once, waiting for an ack. A report keeps its number for
  ever, and they are never dropped: the scaler acks the highest *contiguous*
  number it has, so a hole in the numbers as sent would stall its ack for
  good.
- ``unsent``: reports sampled but not yet numbered.

When the buffer is full the oldest *unsent* report is dropped (and counted);
its node events move to the next report, so a termination notice survives an
outage that drops samples. At most ``max_in_flight`` reports are numbered and
unacked at once, which is what guarantees there is always an unsent report to
drop. Every sampled report is therefore, in the end, acked (delivered), still
held, or counted in ``dropped_total``.

Single-threaded: owned by the agent's event loop.
"""

from __future__ import annotations

import asyncio
import collections

from tide.base.errors import ConfigError
from tide.v1 import telemetry_pb2


class ReportBuffer:
    def __init__(self, capacity: int, max_in_flight: int) -> None:
        if capacity < 2:
            raise ConfigError(f"buffer_reports: must be >= 2, got {capacity!r}")
        if not 1 <= max_in_flight < capacity:
            raise ConfigError(
                f"max_in_flight_reports: must be in 1..{capacity - 1} (below buffer_reports),"
                f" got {max_in_flight!r}"
            )
        self.capacity = capacity
        self.max_in_flight = max_in_flight
        self._in_flight: collections.deque[telemetry_pb2.NodeReport] = collections.deque()
        self._unsent: collections.deque[telemetry_pb2.NodeReport] = collections.deque()
        # Index into _in_flight of the next report to (re)send on the current stream.
        self._cursor = 0
        self._next_seq = 1
        self.added_total = 0
        self.dropped_total = 0
        self.acked_seq = 0
        #: Set whenever there may be something new to send; the sender clears it.
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._in_flight) + len(self._unsent)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def first_unacked_seq(self) -> int | None:
        """The oldest number in flight (what a new stream resends first), if any."""
        return self._in_flight[0].seq if self._in_flight else None

    @property
    def last_seq(self) -> int:
        """The highest sequence number handed out so far (0 before the first send)."""
        return self._next_seq - 1

    def add(self, report: telemetry_pb2.NodeReport) -> None:
        """Hold a freshly sampled report (its seq is assigned later, on first send)."""
        self.added_total += 1
        self._unsent.append(report)
        if len(self) > self.capacity:
            dropped = self._unsent.popleft()
            self.dropped_total += 1
            if dropped.events:
                heir = self._unsent[0]
                carried = [*dropped.events, *heir.events]
                del heir.events[:]
                heir.events.extend(carried)
        self.changed.set()

    def next_to_send(self) -> telemetry_pb2.NodeReport | None:
        """The next report to write on the current stream, or None when there is
        nothing to send (or the in-flight window is full)."""
        if self._cursor < len(self._in_flight):
            report = self._in_flight[self._cursor]
            self._cursor += 1
            return report
        if self._unsent and len(self._in_flight) < self.max_in_flight:
            report = self._unsent.popleft()
            report.seq = self._next_seq
            self._next_seq += 1
            self._in_flight.append(report)
            self._cursor = len(self._in_flight)
            return report
        return None

    def rewind(self) -> None:
        """A new stream starts: everything in flight is sent again, in order."""
        self._cursor = 0
        self.changed.set()

    def ack(self, acked_seq: int) -> int:
        """Forget reports up to ``acked_seq``; returns how many were released."""
        if acked_seq > self.last_seq:
            # An ack for numbers never sent (a confused or foreign scaler): trust only
            # what we sent, or we would forget reports nobody received.
            acked_seq = self.last_seq
        released = 0
        while self._in_flight and self._in_flight[0].seq <= acked_seq:
            self._in_flight.popleft()
            released += 1
        self._cursor = max(0, self._cursor - released)
        self.acked_seq = max(self.acked_seq, acked_seq)
        if released:
            self.changed.set()
        return released
