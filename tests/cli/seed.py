"""A small, known scaling history written through the store's repository.

Used by the offline CLI tests (SQLite) and the runbook SQL tests (PostgreSQL),
so both read exactly what the scaler would have written.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tide.services.scaler import store as repo
from tide.services.store import db

JOB = "ml/resnet"
OTHER = "ml/bert"

#: A Monday, so "this week" is well defined in the runbook tests.
T0 = datetime(2026, 11, 30, 14, 5, 12, tzinfo=UTC)


def inputs(mean: float, buckets: list[float | None], current: int, raw: int) -> dict[str, Any]:
    """DecisionInputs as JSON with the proto's field names, the way explain reads them."""
    return {
        "window": {
            "bucket_s": 30.0,
            "bucket_means_pct": buckets,
            "coverage": 1.0,
            "gpus_expected": current,
            "gpus_fresh": current,
            "mean_pct": mean,
            "computed_at_s": T0.timestamp(),
        },
        "policy": {
            "scale_up_utilization_pct": 80.0,
            "scale_down_utilization_pct": 40.0,
            "sustain_s": 120.0,
            "bucket_s": 30.0,
            "cooldown_s": 300.0,
            "min_replicas": 2,
            "max_replicas": 8,
            "min_coverage": 0.8,
            "max_step": 4,
            "target_utilization_pct": 60.0,
        },
        "current_replicas": current,
        "free_gpus": 6,
        "raw_target_replicas": raw,
    }


@dataclass(frozen=True)
class Seeded:
    grow: int  # 2 → 4 at T0, completed, pause 2.5 s
    shrink: int  # 4 → 2 at T0+2h, completed, pause 1.75 s
    aborted: int  # 2 → 3 at T0+3h, aborted
    manual: int  # ml/bert 2 → 3 at T0+1h, manual, completed
    running: int  # ml/bert 3 → 4 at T0+5h, still PREPARING


def seed(url: str) -> Seeded:
    """Migrate ``url`` to head and write the history; returns the decision ids."""
    db.upgrade(url)
    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    try:
        with db.session_scope(factory) as s:
            for job in (JOB, OTHER):
                repo.upsert_job(s, job, min_replicas=2, max_replicas=8, now=T0 - timedelta(days=1))
            e1 = repo.acquire_job_ownership(s, JOB, "scaler-a", now=T0)
            e2 = repo.acquire_job_ownership(s, OTHER, "scaler-a", now=T0)

        def decide(
            job: str,
            epoch: int,
            at: datetime,
            frm: int,
            to: int,
            reason: str,
            trigger: str,
            end: str,
            *,
            pause_s: float = 0.0,
            by: str = "",
            error: str | None = None,
            message: str = "",
            extra: dict[str, Any] | None = None,
        ) -> int:
            with db.session_scope(factory) as s:
                d = repo.create_decision(
                    s,
                    job_id=job,
                    from_replicas=frm,
                    to_replicas=to,
                    reason=reason,
                    trigger=trigger,
                    message=message or f"{reason.lower()}: {frm} -> {to}",
                    inputs={
                        **inputs(92.0 if to > frm else 21.0, [91.0, None, 93.0, 92.0], frm, to),
                        **(extra or {}),
                    },
                    epoch=epoch,
                    now=at,
                    requested_by=by,
                )
                path = {
                    "COMPLETED": ("PREPARING", "ACTUATING", "COMPLETED"),
                    "ABORTED": ("PREPARING", "ABORTED"),
                    "PREPARING": ("PREPARING",),
                }[end]
                for i, state in enumerate(path, start=1):
                    final = state in ("COMPLETED", "ABORTED")
                    repo.transition_decision(
                        s,
                        d.id,
                        repo.DecisionState(state),
                        detail=f"{state.lower()} (step {i})",
                        epoch=epoch,
                        now=at + timedelta(seconds=3 * i),
                        pause_s=pause_s if final else None,
                        generation=d.id + 1 if state == "COMPLETED" else None,
                        error=error if state == "ABORTED" else None,
                    )
                return d.id

        grow = decide(
            JOB, e1, T0, 2, 4, "SUSTAINED_HIGH_UTILIZATION", "POLICY", "COMPLETED", pause_s=2.5
        )
        manual = decide(
            OTHER,
            e2,
            T0 + timedelta(hours=1),
            2,
            3,
            "MANUAL",
            "MANUAL",
            "COMPLETED",
            pause_s=1.0,
            by="alice",
            message="load test",
        )
        shrink = decide(
            JOB,
            e1,
            T0 + timedelta(hours=2),
            4,
            2,
            "SUSTAINED_LOW_UTILIZATION",
            "POLICY",
            "COMPLETED",
            pause_s=1.75,
        )
        aborted = decide(
            JOB,
            e1,
            T0 + timedelta(hours=3),
            2,
            3,
            "SUSTAINED_HIGH_UTILIZATION",
            "POLICY",
            "ABORTED",
            error="barrier deadline: 1 of 3 members did not ack",
            # The goodput guard and the pool step, as the scaler records them.
            extra={
                "goodput": {
                    "throughput_by_replicas": {"2": 200.0, "4": 300.0},
                    "compared_replicas": 4,
                    "efficiency": 0.5,
                    "min_scale_up_efficiency": 0.5,
                    "verdict": "halved",
                },
                "pool": {
                    "free_gpus": 2,
                    "rule": "marginal",
                    "claims": [
                        {
                            "job_id": JOB,
                            "wanted_gpus": 2,
                            "next_efficiency": 0.5,
                            "granted_gpus": 1,
                        },
                        {
                            "job_id": OTHER,
                            "wanted_gpus": 1,
                            "next_efficiency": 0.9,
                            "granted_gpus": 1,
                        },
                    ],
                },
            },
        )
        running = decide(
            OTHER,
            e2,
            T0 + timedelta(hours=5),
            3,
            4,
            "SUSTAINED_HIGH_UTILIZATION",
            "POLICY",
            "PREPARING",
        )
        with db.session_scope(factory) as s:
            repo.set_paused(s, OTHER, paused=True, reason="INC-7: storage outage", now=T0)
            rows = []
            start = T0.replace(second=0) - timedelta(minutes=10)
            for m in range(0, 3 * 60 + 30):
                minute = start + timedelta(minutes=m)
                at = minute + timedelta(seconds=59)
                replicas = 4 if T0 <= at < T0 + timedelta(hours=2) else 2
                mean = 92.0 if minute < T0 + timedelta(hours=1) else 20.0
                rows.append(
                    repo.RollupRecord(
                        JOB, minute, mean, mean - 4, mean + 4, 60 * replicas, replicas
                    )
                )
            repo.write_rollups(s, rows)
    finally:
        engine.dispose()
    return Seeded(grow, shrink, aborted, manual, running)
