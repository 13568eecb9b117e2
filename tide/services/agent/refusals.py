"""Reports the scaler acknowledged but dropped for their timestamp (TelemetryAck.refused).

Resending such a report cannot help, so the scaler acks it; what it takes to fix is
usually this node's clock. Every refused report is counted
(``tide_agent_reports_refused_total{reason}``); a WARNING goes out for the first
refusal of a cause and then at most once per ``log_interval_s`` per cause, with the
reports refused since the previous one, so that an agent whose clock is off by years
(every report refused) logs a line every few minutes, not one a second.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tide.v1 import telemetry_pb2

from .metrics import AgentMetrics

_REFUSAL = telemetry_pb2.ReportRefusal


def reason_label(reason: int) -> str:
    """The metric's label of a cause: ``timestamp_in_future``, ...; ``unknown`` for a
    cause this agent does not know (a newer scaler)."""
    try:
        name = _REFUSAL.Reason.Name(reason)  # type: ignore[arg-type]
    except ValueError:
        return "unknown"
    return name.removeprefix("REASON_").lower()


def duration_text(seconds: float) -> str:
    """``12.3 s``, ``4.0 min``, ``2.5 h``, ``3.0 days`` or ``10.0 years`` (no sign)."""
    s = abs(seconds)
    for unit, size in (("years", 365.25 * 86400), ("days", 86400.0), ("h", 3600.0)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def describe(r: telemetry_pb2.ReportRefusal) -> str:
    """Why, in words, with the skew the scaler saw."""
    skew = duration_text(r.skew_s)
    if r.reason == _REFUSAL.REASON_TIMESTAMP_IN_FUTURE:
        return (
            f"sampled_at is {skew} ahead of the scaler's clock (it allows "
            f"{duration_text(r.limit_s)}): check this node's clock (NTP)"
        )
    if r.reason == _REFUSAL.REASON_TIMESTAMP_TOO_OLD:
        return (
            f"sampled_at is {skew} behind the scaler's clock (it takes reports up to "
            f"{duration_text(r.limit_s)} old): check this node's clock (NTP)"
        )
    if r.reason == _REFUSAL.REASON_TIMESTAMP_OUT_OF_ORDER:
        return (
            "sampled_at is earlier than that of a report the scaler already took "
            f"({skew} from its clock): this node's clock stepped back"
        )
    if r.reason == _REFUSAL.REASON_TIMESTAMP_MISSING:
        return "sampled_at is unset"
    return f"reason {r.reason} (skew {r.skew_s:+.1f} s)"


class RefusalLog:
    """Counts refused reports and logs them, one WARNING per cause per interval."""

    def __init__(
        self,
        log: logging.LoggerAdapter[logging.Logger],
        metrics: AgentMetrics,
        log_interval_s: float,
    ) -> None:
        self._log = log
        self._metrics = metrics
        self._interval_s = log_interval_s
        # Per cause: when its last WARNING went out (monotonic) and the reports refused
        # since then.
        self._logged_at: dict[int, float] = {}
        self._unlogged: dict[int, int] = {}

    def note(self, refusals: Iterable[telemetry_pb2.ReportRefusal], now_s: float) -> None:
        for r in refusals:
            reason = r.reason
            reports = max(1, r.reports)
            self._metrics.reports_refused.labels(reason_label(reason)).inc(reports)
            count = self._unlogged.get(reason, 0) + reports
            last = self._logged_at.get(reason)
            if last is not None and now_s - last < self._interval_s:
                self._unlogged[reason] = count
                continue
            self._logged_at[reason] = now_s
            self._unlogged[reason] = 0
            self._log.warning(
                "the scaler acknowledged but dropped %d report(s) (%s, last seq %d): %s;"
                " next warning for this cause in %g s at the earliest",
                count,
                reason_label(reason),
                r.last_seq,
                describe(r),
                self._interval_s,
            )
