"""Records of the scaler's store to tide.v1 messages and back: the only copy.

The servicer encodes with these, and so does the CLI when it reads history
straight from the database (``tide history --db``), so both show the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from tide.base.timeconv import ts_from_datetime, ts_from_seconds
from tide.services.scaler import policy as pol
from tide.services.scaler.lifecycle import state_to_proto
from tide.services.scaler.store import (
    DecisionDetailRecord,
    DecisionEventRecord,
    DecisionRecord,
    DecisionState,
    RollupRecord,
)
from tide.v1 import common_pb2, scaler_pb2

_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(pol.PolicySettings))


def policy_to_proto(p: pol.PolicySettings) -> scaler_pb2.Policy:
    return scaler_pb2.Policy(**{n: getattr(p, n) for n in _POLICY_FIELDS})


def policy_from_proto(msg: scaler_pb2.Policy) -> dict[str, Any]:
    """Only the fields the caller set."""
    return {n: getattr(msg, n) for n in _POLICY_FIELDS if msg.HasField(n)}  # type: ignore[arg-type]


def _bucket(mean: float | None) -> common_pb2.WindowBucket:
    """An empty bucket (NaN in the window, null in stored inputs) is marked, not NaN."""
    if mean is None or math.isnan(mean):
        return common_pb2.WindowBucket(empty=True)
    return common_pb2.WindowBucket(mean_pct=mean)


def _window(
    bucket_s: float,
    means: Sequence[float | None],
    coverage: float,
    expected: int,
    fresh: int,
    mean: float | None,
    at_s: float | None,
) -> common_pb2.WindowStats:
    msg = common_pb2.WindowStats(
        bucket_s=bucket_s,
        buckets=[_bucket(m) for m in means],
        coverage=coverage,
        gpus_expected=expected,
        gpus_fresh=fresh,
        computed_at=ts_from_seconds(at_s),
    )
    if mean is not None and not math.isnan(mean):
        msg.mean_pct = mean
    return msg


def window_to_proto(w: pol.WindowView, at_s: float) -> common_pb2.WindowStats:
    return _window(
        w.bucket_s, w.bucket_means, w.coverage, w.gpus_expected, w.gpus_fresh, w.mean_pct, at_s
    )


def decision_to_proto(d: DecisionRecord) -> scaler_pb2.Decision:
    return scaler_pb2.Decision(
        id=d.id,
        job_id=d.job_id,
        from_replicas=d.from_replicas,
        to_replicas=d.to_replicas,
        reason=common_pb2.DecisionReason.Value(f"DECISION_REASON_{d.reason}"),
        message=d.message,
        trigger=common_pb2.DecisionTrigger.Value(f"DECISION_TRIGGER_{d.trigger}"),
        state=state_to_proto(d.state),
        created_at=ts_from_datetime(d.created_at),
        updated_at=ts_from_datetime(d.updated_at),
        error=d.error,
        pause_s=d.pause_s,
        lost_steps=d.lost_steps,
        generation=d.generation,
        requested_by=d.requested_by,
    )


def _names(enum: Any, prefix: str) -> dict[str, Any]:
    return {v.name.removeprefix(prefix): v.number for v in enum.DESCRIPTOR.values}


_REASONS = _names(common_pb2.DecisionReason, "DECISION_REASON_")
_TRIGGERS = _names(common_pb2.DecisionTrigger, "DECISION_TRIGGER_")
_STATES = {s.value: state_to_proto(s) for s in DecisionState}
_EPOCH = datetime(1970, 1, 1)


def _utc_ts(naive_utc: datetime) -> Timestamp:
    """The Timestamp of a naive UTC datetime, in integer arithmetic."""
    d = naive_utc - _EPOCH
    return Timestamp(seconds=d.days * 86400 + d.seconds, nanos=d.microseconds * 1000)


def decision_row_to_proto(row: Any) -> scaler_pb2.Decision:
    """:func:`decision_to_proto` of a row of ``store.history_table_rows(wide=True)``
    (names as stored, times naive UTC), with no record between and the enums from
    tables: the API's ListDecisions pages (tests/cli/test_history_rows.py holds the
    two equal)."""
    (
        i,
        created,
        job,
        frm,
        to,
        reason,
        state,
        pause,
        by,
        trigger,
        gen,
        lost,
        updated,
        error,
        msg,
    ) = row
    return scaler_pb2.Decision(
        id=i,
        job_id=job,
        from_replicas=frm,
        to_replicas=to,
        reason=_REASONS[reason]
        if reason in _REASONS
        else common_pb2.DecisionReason.Value(f"DECISION_REASON_{reason}"),
        message=msg,
        trigger=_TRIGGERS[trigger]
        if trigger in _TRIGGERS
        else common_pb2.DecisionTrigger.Value(f"DECISION_TRIGGER_{trigger}"),
        state=_STATES[state],
        created_at=_utc_ts(created),
        updated_at=_utc_ts(updated),
        error=error,
        pause_s=pause,
        lost_steps=lost,
        generation=gen,
        requested_by=by,
    )


def decision_inputs(
    current_replicas: int,
    p: pol.PolicySettings,
    view: pol.WindowView,
    free: int | None,
    d: pol.Decision,
    at: float,
) -> dict[str, Any]:
    """What a decision is stored with (``decisions.inputs``), read back by
    :func:`inputs_to_proto`: the window, the effective policy, the replicas, the free
    GPUs, the proportional answer, and the policy's own evidence (goodput, pool)."""
    return {
        "window": {
            "bucket_s": view.bucket_s,
            "end_s": view.end_s,
            "bucket_means_pct": list(view.bucket_means),
            "coverage": view.coverage,
            "gpus_expected": view.gpus_expected,
            "gpus_fresh": view.gpus_fresh,
            "mean_pct": view.mean_pct,
            "computed_at_s": at,
        },
        # The signal the job scaled on and its buckets (the window above is utilization).
        "signal": pol.signal_evidence(view, p),
        "policy": dataclasses.asdict(p),
        "current_replicas": current_replicas,
        "free_gpus": -1 if free is None else free,
        "raw_target_replicas": d.raw_target,
        **d.inputs,
    }


def inputs_to_proto(inputs: dict[str, Any]) -> scaler_pb2.DecisionInputs:
    msg = scaler_pb2.DecisionInputs(
        current_replicas=int(inputs.get("current_replicas", 0)),
        free_gpus=int(inputs.get("free_gpus", -1)),
        raw_target_replicas=max(0, int(inputs.get("raw_target_replicas", 0))),
        node_name=str(inputs.get("node_name", "") or ""),
        leaving_pods=[str(x) for x in inputs.get("leaving_pods", []) or []],
        barrier_deadline_s=float(inputs.get("barrier_deadline_s", 0.0) or 0.0),
    )
    plan = inputs.get("notice_plan")
    if plan:
        msg.notice_plan = f"{plan.get('reason', '')}: {plan.get('message', '')}"
    w = inputs.get("window")
    if w:
        mean = w.get("mean_pct")
        msg.window.CopyFrom(
            _window(
                float(w.get("bucket_s", 0.0)),
                [None if v is None else float(v) for v in w.get("bucket_means_pct", [])],
                float(w.get("coverage", 0.0)),
                int(w.get("gpus_expected", 0)),
                int(w.get("gpus_fresh", 0)),
                None if mean is None else float(mean),
                w.get("computed_at_s"),
            )
        )
    p = inputs.get("policy")
    if p:
        msg.policy.CopyFrom(
            scaler_pb2.Policy(**{k: v for k, v in p.items() if k in _POLICY_FIELDS})
        )
    deadline = ts_from_seconds(inputs.get("node_deadline_s"))
    if deadline is not None:
        msg.node_deadline.CopyFrom(deadline)
    g = inputs.get("goodput")
    if g:
        eff = g.get("efficiency")
        msg.goodput.CopyFrom(
            scaler_pb2.GoodputEvidence(
                measured=[
                    scaler_pb2.ThroughputPoint(replicas=int(r), samples_per_s=float(v))
                    for r, v in sorted(
                        g.get("throughput_by_replicas", {}).items(), key=lambda kv: int(kv[0])
                    )
                ],
                compared_replicas=int(g.get("compared_replicas") or 0),
                efficiency=None if eff is None else float(eff),
                min_scale_up_efficiency=float(g.get("min_scale_up_efficiency", 0.0)),
                verdict=str(g.get("verdict", "")),
            )
        )
    pool = inputs.get("pool")
    if pool:
        msg.pool.CopyFrom(
            scaler_pb2.PoolEvidence(
                free_gpus=int(pool.get("free_gpus", -1)),
                rule=str(pool.get("rule", "")),
                claims=[
                    scaler_pb2.PoolClaim(
                        job_id=str(c["job_id"]),
                        wanted_gpus=int(c["wanted_gpus"]),
                        next_efficiency=float(c["next_efficiency"]),
                        granted_gpus=int(c["granted_gpus"]),
                    )
                    for c in pool.get("claims", [])
                ],
            )
        )
    return msg


def point_to_proto(
    r: RollupRecord, seconds: tuple[Sequence[float], Sequence[int]] | None = None
) -> scaler_pb2.UtilizationPoint:
    """A minute; with ``seconds`` (its per-second sums and counts) its detail too."""
    msg = scaler_pb2.UtilizationPoint(
        minute=ts_from_datetime(r.minute),
        mean_pct=r.mean_pct,
        min_pct=r.min_pct,
        max_pct=r.max_pct,
        samples=r.samples,
        replicas=r.replicas,
    )
    if seconds is not None:
        sums, counts = seconds
        msg.second_mean_pct.extend(t / c if c else 0.0 for t, c in zip(sums, counts, strict=True))
        msg.second_samples.extend(counts)
    return msg


def event_to_proto(e: DecisionEventRecord, job_id: str) -> scaler_pb2.DecisionEvent:
    return scaler_pb2.DecisionEvent(
        decision_id=e.decision_id,
        job_id=job_id,
        state=state_to_proto(e.state),
        at=ts_from_datetime(e.at),
        detail=e.detail,
    )


def detail_to_proto(
    detail: DecisionDetailRecord, rollups: Sequence[RollupRecord]
) -> scaler_pb2.DecisionDetail:
    """A decision with its inputs, its events (oldest first) and the given rollups."""
    d = detail.decision
    return scaler_pb2.DecisionDetail(
        decision=decision_to_proto(d),
        inputs=inputs_to_proto(d.inputs),
        events=[event_to_proto(e, d.job_id) for e in detail.events],
        utilization=[point_to_proto(r) for r in rollups],
    )
