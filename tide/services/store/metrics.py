"""The store's Prometheus metrics: units of work retried, and units that gave up.

Module-level, in the default registry: :func:`tide.services.store.db.unit_of_work` is
a function every stateful service calls, and each process has one store.
``cause`` is bounded: connection_lost, connection_failed, store_unusable,
serialization_failure, deadlock, busy
(SQLite), stale_write (a version counter moved), other.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RETRIES = Counter(
    "tide_store_retries_total",
    "Units of work run again after a failure that left no effect, by cause.",
    ("cause",),
)
FAILURES = Counter(
    "tide_store_failures_total",
    "Units of work that gave up after their last attempt, by cause (the caller got"
    " Unavailable, or StaleWrite for stale_write).",
    ("cause",),
)

#: Every cause, so that each series exists (at 0) before its first increment: an
#: alert on ``increase()`` needs a sample before the failure to see it.
CAUSES = (
    "connection_lost",
    "connection_failed",
    "store_unusable",
    "serialization_failure",
    "deadlock",
    "busy",
    "stale_write",
    "other",
)
for _cause in CAUSES:
    RETRIES.labels(_cause)
    FAILURES.labels(_cause)

UP = Gauge(
    "tide_store_up",
    "1 while the store probe finds the store usable (it answers, and a SQLite file's"
    " disk is writable with room to spare), else 0.",
)
UP.set(1)
OUTAGES = Counter(
    "tide_store_outages_total",
    "Times the store probe found the store down, by cause: unreachable (the driver's"
    " error), timeout, read_only, disk_full (SQLite's file system).",
    ("cause",),
)
OUTAGE_CAUSES = ("unreachable", "timeout", "read_only", "disk_full")
for _cause in OUTAGE_CAUSES:
    OUTAGES.labels(_cause)
