"""The CLI's output: tables for people, and JSON / CSV with a versioned schema for scripts.

The JSON documents are described in docs/cli.md. Changing a field's name,
type or unit means a new SCHEMA_VERSION; adding a field does not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from tide.base.timeconv import field_datetime
from tide.services.cli.timeparse import iso, short
from tide.v1 import common_pb2, scaler_pb2

if TYPE_CHECKING:
    from rich.console import Console

SCHEMA_VERSION = 1

FINAL_STATES = frozenset(
    {
        common_pb2.DECISION_STATE_COMPLETED,
        common_pb2.DECISION_STATE_ABORTED,
        common_pb2.DECISION_STATE_FAILED,
    }
)


# The generated enum wrappers type their values as NewTypes of int; the
# messages' fields are plain ints at runtime, so Any bridges the two.
_Reason: Any = common_pb2.DecisionReason
_State: Any = common_pb2.DecisionState
_Trigger: Any = common_pb2.DecisionTrigger


def reason_name(value: int) -> str:
    return str(_Reason.Name(value)).removeprefix("DECISION_REASON_")


def state_name(value: int) -> str:
    return str(_State.Name(value)).removeprefix("DECISION_STATE_")


def trigger_name(value: int) -> str:
    return str(_Trigger.Name(value)).removeprefix("DECISION_TRIGGER_")


def state_value(name: str) -> int:
    """``completed`` / ``COMPLETED`` / ``DECISION_STATE_COMPLETED`` → enum value; ValueError if none."""
    key = name.strip().upper().removeprefix("DECISION_STATE_")
    value = int(common_pb2.DecisionState.Value("DECISION_STATE_" + key))
    if value == 0:
        raise ValueError(name)
    return value


# --- JSON documents -------------------------------------------------------------------------


def decision_doc(d: scaler_pb2.Decision) -> dict[str, Any]:
    return {
        "id": d.id,
        "job_id": d.job_id,
        "from_replicas": d.from_replicas,
        "to_replicas": d.to_replicas,
        "reason": reason_name(d.reason),
        "trigger": trigger_name(d.trigger),
        "state": state_name(d.state),
        "message": d.message,
        "error": d.error,
        "created_at": iso(field_datetime(d, "created_at")),
        "updated_at": iso(field_datetime(d, "updated_at")),
        "pause_s": d.pause_s,
        "lost_steps": d.lost_steps,
        "generation": d.generation,
        "requested_by": d.requested_by,
    }


#: Column order of `tide history --output csv`: the decision document's keys.
CSV_COLUMNS = tuple(decision_doc(scaler_pb2.Decision()).keys())


def bucket_means(w: common_pb2.WindowStats) -> list[float | None]:
    """Each bucket's mean, None for an empty one (the API marks it ``empty``)."""
    return [None if b.empty or not b.HasField("mean_pct") else b.mean_pct for b in w.buckets]


def window_mean(w: common_pb2.WindowStats) -> float | None:
    return w.mean_pct if w.HasField("mean_pct") else None


def window_doc(w: common_pb2.WindowStats) -> dict[str, Any]:
    return {
        "bucket_s": w.bucket_s,
        "bucket_means_pct": bucket_means(w),
        "coverage": w.coverage,
        "gpus_expected": w.gpus_expected,
        "gpus_fresh": w.gpus_fresh,
        "mean_pct": window_mean(w),
        "computed_at": iso(field_datetime(w, "computed_at")),
    }


def policy_doc(p: scaler_pb2.Policy) -> dict[str, Any]:
    """Only the fields that are set: an absent key means "not known", never 0."""
    msg: Any = p
    return {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if msg.HasField(f.name)}


def job_doc(j: scaler_pb2.Job) -> dict[str, Any]:
    ev = j.last_evaluation
    return {
        "job_id": j.job_id,
        "current_replicas": j.current_replicas,
        "min_replicas": j.policy.min_replicas,
        "max_replicas": j.policy.max_replicas,
        "gpus_per_replica": j.gpus_per_replica,
        "generation": j.generation,
        "step": j.step,
        "samples_per_s": j.samples_per_s,
        "utilization_pct": window_mean(j.window) if j.HasField("window") else None,
        "coverage": j.window.coverage if j.HasField("window") else None,
        "autoscaling_paused": j.autoscaling_paused,
        "pause_reason": j.pause_reason,
        "active_decision_id": j.active_decision_id or None,
        "last_evaluation": (
            {
                "reason": reason_name(ev.reason),
                "message": ev.message,
                "at": iso(field_datetime(ev, "at")),
            }
            if j.HasField("last_evaluation")
            else None
        ),
        "last_resize_at": iso(field_datetime(j, "last_resize_at")),
        "created_at": iso(field_datetime(j, "created_at")),
        "policy": policy_doc(j.policy),
        "failure": j.failure or None,
    }


def event_doc(e: scaler_pb2.DecisionEvent) -> dict[str, Any]:
    return {"state": state_name(e.state), "at": iso(field_datetime(e, "at")), "detail": e.detail}


def point_doc(p: scaler_pb2.UtilizationPoint) -> dict[str, Any]:
    return {
        "minute": iso(field_datetime(p, "minute")),
        "mean_pct": p.mean_pct,
        "min_pct": p.min_pct,
        "max_pct": p.max_pct,
        "samples": p.samples,
        "replicas": p.replicas,
    }


def explain_doc(detail: scaler_pb2.DecisionDetail) -> dict[str, Any]:
    i = detail.inputs
    return {
        "decision": decision_doc(detail.decision),
        "inputs": {
            "window": window_doc(i.window),
            "policy": policy_doc(i.policy),
            "current_replicas": i.current_replicas,
            "free_gpus": i.free_gpus,
            "raw_target_replicas": i.raw_target_replicas,
            "node_name": i.node_name,
            "node_deadline": iso(field_datetime(i, "node_deadline")),
            "goodput": goodput_doc(i.goodput) if i.HasField("goodput") else None,
            "pool": pool_doc(i.pool) if i.HasField("pool") else None,
        },
        "events": [event_doc(e) for e in detail.events],
        "utilization": [point_doc(p) for p in detail.utilization],
    }


def document(kind: str, **body: Any) -> dict[str, Any]:
    """A versioned output document (docs/cli.md): ``schema_version``, ``kind``, the body."""
    return {"schema_version": SCHEMA_VERSION, "kind": kind, **body}


def goodput_doc(g: scaler_pb2.GoodputEvidence) -> dict[str, Any]:
    return {
        "throughput_by_replicas": {str(p.replicas): p.samples_per_s for p in g.measured},
        "compared_replicas": g.compared_replicas or None,
        "efficiency": g.efficiency if g.HasField("efficiency") else None,
        "min_scale_up_efficiency": g.min_scale_up_efficiency,
        "verdict": g.verdict,
    }


def pool_doc(p: scaler_pb2.PoolEvidence) -> dict[str, Any]:
    return {
        "free_gpus": p.free_gpus,
        "rule": p.rule,
        "claims": [
            {
                "job_id": c.job_id,
                "wanted_gpus": c.wanted_gpus,
                "next_efficiency": c.next_efficiency,
                "granted_gpus": c.granted_gpus,
            }
            for c in p.claims
        ],
    }


def envelope(kind: str, **body: Any) -> str:
    return json.dumps(document(kind, **body), indent=2)


def event_doc_full(e: scaler_pb2.DecisionEvent) -> dict[str, Any]:
    """A WatchDecisions event (`tide history -w`, `tide scale --wait`): the change and
    the decision after it."""
    return document(
        "tide.decision_event",
        decision_id=e.decision_id,
        job_id=e.job_id,
        state=state_name(e.state),
        at=iso(field_datetime(e, "at")),
        detail=e.detail,
        decision=decision_doc(e.decision),
    )


# --- tables ---------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.0f}%"


#: `tide jobs --db`: what only a running scaler knows (its memory, not the store). The
#: JSON keeps these keys with their zero/null values and names them in ``unavailable_fields``.
OFFLINE_UNAVAILABLE = (
    "step",
    "samples_per_s",
    "utilization_pct",
    "coverage",
    "last_evaluation",
    "failure",
)
OFFLINE_NOTE = (
    "read from the store (--db): STEP, SAMPLES/S, UTIL and LAST EVALUATION are known only to"
    " a running scaler (n/a); a job's policy here is its stored overrides and bounds, the"
    " defaults being the scaler's configuration."
)


def jobs_envelope_fields(offline: bool) -> dict[str, Any]:
    """What a `tide.jobs` document says about where it came from and what it lacks."""
    return {
        "source": "db" if offline else "scaler",
        "unavailable_fields": list(OFFLINE_UNAVAILABLE) if offline else [],
        # "effective": defaults merged with overrides; "overrides": only what is stored.
        "policy_scope": "overrides" if offline else "effective",
    }


Rows = tuple[tuple[str, ...], list[tuple[str, ...]]]


def jobs_rows(jobs: Sequence[scaler_pb2.Job], *, offline: bool = False, wide: bool = False) -> Rows:
    """Headers and rows of `tide jobs` (``wide``: coverage, GPUs per replica, the active
    decision and the last resize too)."""
    headers: tuple[str, ...] = (
        "JOB",
        "REPLICAS",
        "MIN..MAX",
        "GEN",
        "STEP",
        "SAMPLES/S",
        "UTIL",
        "AUTOSCALING",
    )
    if wide:
        headers += ("COVERAGE", "GPUS/REPLICA", "ACTIVE DECISION", "LAST RESIZE (UTC)")
    headers += ("LAST EVALUATION",)
    rows = []
    for j in jobs:
        auto = f"paused: {j.pause_reason}" if j.autoscaling_paused else "on"
        if j.failure:
            auto = f"off: job FAILED ({j.failure.splitlines()[0]})"
        if j.active_decision_id and not wide:
            auto += f" (decision {j.active_decision_id} running)"
        ev = j.last_evaluation
        window = j.HasField("window")
        live = (
            ("n/a",) * 4
            if offline
            else (
                str(j.step),
                f"{j.samples_per_s:.1f}",
                _pct(window_mean(j.window)) if window else "-",
                f"{reason_name(ev.reason)}: {ev.message}" if j.HasField("last_evaluation") else "-",
            )
        )
        row: tuple[str, ...] = (
            j.job_id,
            str(j.current_replicas),
            f"{j.policy.min_replicas}..{j.policy.max_replicas}",
            str(j.generation),
            live[0],
            live[1],
            live[2],
            auto,
        )
        if wide:
            row += (
                "n/a" if offline or not window else f"{j.window.coverage:.0%}",
                str(j.gpus_per_replica),
                str(j.active_decision_id) if j.active_decision_id else "-",
                short(field_datetime(j, "last_resize_at")),
            )
        rows.append((*row, live[3]))
    return headers, rows


#: The columns of `tide history` that hold text as people wrote it (BY, MESSAGE; the
#: last counted from the end, so that it holds for the wide table too).
HISTORY_FREE_TEXT = (7, -1)


def history_headers(*, wide: bool = False) -> tuple[str, ...]:
    """The columns of `tide history` (``wide``: trigger, generation, lost steps, the
    last change)."""
    headers: tuple[str, ...] = (
        "ID",
        "CREATED (UTC)",
        "JOB",
        "RESIZE",
        "REASON",
        "STATE",
        "PAUSE",
        "BY",
    )
    if wide:
        headers += ("TRIGGER", "GEN", "LOST STEPS", "UPDATED (UTC)")
    return (*headers, "MESSAGE")


def history_rows(decisions: Sequence[scaler_pb2.Decision], *, wide: bool = False) -> Rows:
    """Headers and rows of `tide history`, of the API's decisions: the enums' names
    looked up in a table and the times made from the Timestamp's seconds, not through
    a datetime per field (100,000 rows of ``--all``, docs/cli.md)."""
    reasons, states, triggers = _NAMES
    rows: list[tuple[str, ...]] = []
    add = rows.append
    for d in decisions:
        trigger = triggers.get(d.trigger) or trigger_name(d.trigger)
        row: tuple[str, ...] = (
            str(d.id),
            _short_ts(d, "created_at"),
            d.job_id,
            f"{d.from_replicas}→{d.to_replicas}",
            reasons.get(d.reason) or reason_name(d.reason),
            states.get(d.state) or state_name(d.state),
            f"{d.pause_s:.2f}s" if d.pause_s else "-",
            d.requested_by or trigger.lower(),
        )
        if wide:
            row += (trigger, str(d.generation), str(d.lost_steps), _short_ts(d, "updated_at"))
        add((*row, d.error or d.message))
    return history_headers(wide=wide), rows


def _enum_names(enum: Any, prefix: str) -> dict[int, str]:
    return {v.number: v.name.removeprefix(prefix) for v in enum.DESCRIPTOR.values}


#: Each enum value's shown name (reason, state, trigger); a value this build does not
#: know falls back to the name functions (which raise, as before).
_NAMES = (
    _enum_names(_Reason, "DECISION_REASON_"),
    _enum_names(_State, "DECISION_STATE_"),
    _enum_names(_Trigger, "DECISION_TRIGGER_"),
)

_EPOCH = datetime(1970, 1, 1)


def _short_ts(msg: Any, name: str) -> str:
    """``short(field_datetime(msg, name))`` from the Timestamp's whole seconds (the
    table shows no fraction)."""
    if not msg.HasField(name):
        return "-"
    return (_EPOCH + timedelta(seconds=getattr(msg, name).seconds)).isoformat(" ", "seconds")


def history_rows_of_store(rows: Sequence[Any], *, wide: bool = False) -> list[tuple[str, ...]]:
    """The rows of `tide history` straight from the store's rows (``store.history_table_rows``,
    in its column order: the reason, state and trigger are the names the API's enums
    carry, the times naive UTC): each row converted once, not to a record and a message
    first, in one comprehension (100,000 rows of ``--all``, docs/cli.md)."""
    if wide:
        return [
            (
                str(i),
                created.isoformat(" ", "seconds"),
                job,
                f"{frm}→{to}",
                reason,
                state,
                f"{pause:.2f}s" if pause else "-",
                by or trigger.lower(),
                trigger,
                str(generation),
                str(lost),
                updated.isoformat(" ", "seconds"),
                error or message,
            )
            for (
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
                generation,
                lost,
                updated,
                error,
                message,
            ) in rows
        ]
    return [
        (
            str(i),
            created.isoformat(" ", "seconds"),
            job,
            f"{frm}→{to}",
            reason,
            state,
            f"{pause:.2f}s" if pause else "-",
            by or trigger.lower(),
            error or message,
        )
        for (i, created, job, frm, to, reason, state, pause, by, trigger, error, message) in rows
    ]


def print_explain(console: Console, detail: scaler_pb2.DecisionDetail) -> None:
    d, i = detail.decision, detail.inputs
    p = i.policy
    console.print(
        f"[bold]Decision {d.id}[/bold]  {d.job_id}  {d.from_replicas} → {d.to_replicas} replicas"
        f"  [{state_name(d.state)}]"
    )
    console.print(f"  reason   {reason_name(d.reason)} ({trigger_name(d.trigger).lower()})")
    console.print(f"  message  {d.message}")
    if d.requested_by:
        console.print(f"  by       {d.requested_by}")
    console.print(f"  created  {short(field_datetime(d, 'created_at'))} UTC")
    if d.error:
        console.print(f"  [red]error    {d.error}[/red]")

    console.print("\n[bold]Inputs[/bold]")
    if d.reason == common_pb2.DECISION_REASON_RECONCILE:
        # Not the policy's: the scaler compared its record with what runs, and put its
        # record back. No window or thresholds took part (they would read "bounds 0..0").
        console.print(f"  compared the last decision's size with what runs: {d.message}")
        _print_states(console, detail)
        return
    w = i.window
    means = bucket_means(w)
    buckets = " ".join(_pct(b) for b in means) or "-"
    console.print(
        f"  window   mean {_pct(window_mean(w))} over {len(means)} buckets"
        f" of {w.bucket_s:g} s: {buckets}"
    )
    console.print(
        f"  coverage {w.coverage:.0%} ({w.gpus_fresh}/{w.gpus_expected} GPUs fresh;"
        f" needs {p.min_coverage:.0%})"
    )
    console.print(
        f"  replicas {i.current_replicas} now; proportional rule asked {i.raw_target_replicas};"
        f" free GPUs {'unknown' if i.free_gpus < 0 else i.free_gpus}"
    )
    if i.node_name:
        console.print(
            f"  node     {i.node_name}, leaving by {short(field_datetime(i, 'node_deadline'))} UTC"
        )
    if i.HasField("goodput"):
        g = i.goodput
        curve = ", ".join(f"{p.replicas}: {p.samples_per_s:.1f}" for p in g.measured) or "-"
        console.print(f"  goodput  samples/s by replicas {curve}")
        if g.compared_replicas:
            eff = f"{g.efficiency:.2f}" if g.HasField("efficiency") else "unmeasured"
            console.print(
                f"           against {g.compared_replicas} replicas: {eff} of a replica's"
                f" throughput per added replica (needs {g.min_scale_up_efficiency:.2f});"
                f" {g.verdict}"
            )
    if i.HasField("pool"):
        pool = i.pool
        shares = ", ".join(
            f"{c.job_id} wants {c.wanted_gpus} (next replica {c.next_efficiency:.2f}) gets"
            f" {c.granted_gpus}"
            for c in pool.claims
        )
        console.print(f"  pool     {pool.free_gpus} free GPUs by the {pool.rule} rule: {shares}")
    console.print("\n[bold]Thresholds[/bold]")
    console.print(
        f"  scale up above {p.scale_up_utilization_pct:g}%, down below"
        f" {p.scale_down_utilization_pct:g}%, target {p.target_utilization_pct:g}%"
    )
    console.print(
        f"  sustain {p.sustain_s:g} s in buckets of {p.bucket_s:g} s; cooldown {p.cooldown_s:g} s;"
        f" bounds {p.min_replicas}..{p.max_replicas}, at most ±{p.max_step} per decision"
    )

    _print_states(console, detail)
    _print_utilization(console, detail)


def _print_states(console: Console, detail: scaler_pb2.DecisionDetail) -> None:
    d = detail.decision
    console.print("\n[bold]States[/bold]")
    start = field_datetime(d, "created_at")
    for e in detail.events:
        at = field_datetime(e, "at")
        offset = f"+{(at - start).total_seconds():7.2f}s" if at and start else ""
        console.print(f"  {short(at)}  {offset}  {state_name(e.state):<10} {e.detail}")
    if d.state in FINAL_STATES:
        console.print(
            f"  pause {d.pause_s:.2f} s, lost steps {d.lost_steps}, generation {d.generation}"
        )


def _print_utilization(console: Console, detail: scaler_pb2.DecisionDetail) -> None:
    start = field_datetime(detail.decision, "created_at")
    console.print("\n[bold]Utilization around it[/bold] (per minute, UTC)")
    if not detail.utilization:
        console.print("  no rollups recorded")
    created_minute = start.replace(second=0, microsecond=0) if start else None
    for u in detail.utilization:
        minute = field_datetime(u, "minute")
        mark = "  ◀ decision" if minute == created_minute else ""
        console.print(
            f"  {short(minute)}  mean {u.mean_pct:5.1f}%  min {u.min_pct:5.1f}%"
            f"  max {u.max_pct:5.1f}%  replicas {u.replicas}{mark}"
        )
