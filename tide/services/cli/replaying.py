"""The work behind `tide whatif` (tide/services/cli/whatif.py): the job's recorded history as
the replay's input, the policy it ran with, and the table of both runs.

Kept apart from the command so that the replay and the policy are imported when
`tide whatif` runs, not by every `tide` command at start-up (issue 18)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from tide.base import errors
from tide.base.timeconv import field_datetime
from tide.services.cli import render
from tide.services.cli.app import Exit, fail
from tide.services.cli.timeparse import short
from tide.services.scaler import policy as pol
from tide.services.scaler.convert import policy_from_proto
from tide.services.sim import replay as rp
from tide.v1 import scaler_pb2

#: Decisions whose inputs are read for the replay (the recorded policy, free GPUs,
#: throughput evidence): one GetDecision each.
MAX_DECISIONS = 2000


def _s(msg: Any, name: str) -> float | None:
    dt = field_datetime(msg, name)
    return None if dt is None else dt.timestamp()


def recorded(d: scaler_pb2.Decision, detail: scaler_pb2.DecisionDetail | None) -> rp.Recorded:
    final = d.state in render.FINAL_STATES
    free = throughput = None
    if detail is not None:
        i = detail.inputs
        free = i.free_gpus if i.free_gpus >= 0 else None
        if i.HasField("goodput"):
            throughput = tuple((p.replicas, p.samples_per_s) for p in i.goodput.measured)
    created = _s(d, "created_at") or 0.0
    return rp.Recorded(
        id=d.id,
        created_s=created,
        ended_s=(_s(d, "updated_at") or created) if final else None,
        from_replicas=d.from_replicas,
        to_replicas=d.to_replicas,
        reason=render.reason_name(d.reason),
        trigger=render.trigger_name(d.trigger),
        state=render.state_name(d.state),
        message=d.message,
        free_gpus=free,
        throughput=throughput,
    )


def seconds_of(points: list[scaler_pb2.UtilizationPoint], lo: float, hi: float) -> list[rp.Second]:
    out: list[rp.Second] = []
    for p in points:
        m = _s(p, "minute")
        if m is None:
            continue
        if len(p.second_samples) == 60:
            for i in range(60):
                if lo <= m + i < hi:
                    out.append(rp.Second(m + i, p.second_mean_pct[i], p.second_samples[i]))
        elif lo <= m < hi:
            out.append(rp.Second(m, p.mean_pct, p.samples, 60.0))
    out.sort(key=lambda s: s.t_s)
    return out


def history(
    job: scaler_pb2.Job,
    points: list[scaler_pb2.UtilizationPoint],
    decisions: list[rp.Recorded],
    lo: float,
    hi: float,
) -> rp.JobHistory:
    seconds = seconds_of(points, lo, hi)
    done_before = [d for d in decisions if d.state == "COMPLETED" and (d.ended_s or 0) <= lo]
    later = [d for d in decisions if d.created_s >= lo]
    if done_before:
        start_replicas = done_before[-1].to_replicas
    elif later:
        start_replicas = later[0].from_replicas
    else:
        start_replicas = job.current_replicas
    return rp.JobHistory(
        job_id=job.job_id,
        gpus_per_replica=max(1, job.gpus_per_replica),
        start_s=lo,
        end_s=hi,
        replicas_at_start=start_replicas,
        seconds=tuple(seconds),
        decisions=tuple(decisions),
        detail_s=float(sum(1 for s in seconds if s.length_s == 1.0)),
    )


def recorded_policy(
    job: scaler_pb2.Job, details: list[scaler_pb2.DecisionDetail]
) -> pol.PolicySettings:
    """The policy the job's latest decision recorded; else the job's effective one."""
    for d in reversed(details):
        if d.inputs.HasField("policy") and d.inputs.policy.HasField("sustain_s"):
            return pol.PolicySettings().with_overrides(policy_from_proto(d.inputs.policy))
    return pol.PolicySettings().with_overrides(policy_from_proto(job.policy))


def policy_file(path: Path, base: pol.PolicySettings) -> pol.PolicySettings:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        fail(Exit.USAGE, f"--policy: cannot read {str(path)!r}: {exc.strerror}")
    except yaml.YAMLError as exc:
        fail(Exit.USAGE, f"--policy: {str(path)!r} is not YAML: {exc}")
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        fail(Exit.USAGE, f"--policy: {str(path)!r} must map policy fields to values")
    try:
        return base.with_overrides(doc)
    except errors.ConfigError as exc:
        fail(Exit.USAGE, f"--policy {path}: {exc}")
    except TypeError as exc:
        fail(Exit.USAGE, f"--policy {path}: {exc}")


def _cell(x: Any) -> str:
    mark = "" if getattr(x, "state", "COMPLETED") == "COMPLETED" else f" [{x.state.lower()}]"
    return f"{x.from_replicas} → {x.to_replicas} {x.reason.lower()}{mark}"


def table(
    h: rp.JobHistory, runs: list[tuple[str, rp.ReplayResult]]
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: the recorded decisions and each replay's, by time."""
    headers = ["TIME (UTC)", "RECORDED", *(name.upper() for name, _ in runs)]
    rows: dict[float, list[str]] = {}

    def put(at: float, col: int, text: str) -> None:
        # Decisions within 2 s of each other share a row.
        key = next((k for k in rows if abs(k - at) <= 2.0 and not rows[k][col]), at)
        rows.setdefault(key, [""] * (1 + len(runs)))[col] = text

    for d in h.decisions:
        if h.start_s <= d.created_s < h.end_s:
            put(d.created_s, 0, _cell(d))
    for i, (_, r) in enumerate(runs, start=1):
        for x in r.decisions:
            put(x.at_s, i, _cell(x))
    return headers, [[short(datetime.fromtimestamp(at, tz=UTC)), *rows[at]] for at in sorted(rows)]
