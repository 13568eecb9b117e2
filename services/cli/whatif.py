"""`tide whatif JOB --policy FILE`: what another policy would have done with the job's own
history (services/sim/replay.py): its decisions beside the real ones, and GPU-hours.

Without --policy it replays the policy the job really ran with: the self-check,
whose decisions must be the recorded ones."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from tide.v1 import scaler_pb2

from services.cli import render
from services.cli.app import Exit, echo, fail, now_utc, time_option
from services.cli.connection import Connection, connection_options
from services.cli.output import NoHeadersOpt, OutputOpt, emit_document, print_table
from services.cli.read import output_option
from services.cli.simulate import clean
from services.cli.timeparse import iso, short
from services.scaler import policy as pol
from services.scaler.convert import policy_from_proto
from services.sim import replay as rp
from tidebase import errors
from tidebase.timeconv import field_datetime


class LoadModel(StrEnum):
    proportional = "proportional"
    same = "same"


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


@connection_options(db=True)
def whatif_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    policy: Annotated[
        Path | None,
        typer.Option(help="YAML of policy fields to change (docs/policy.md); omit: self-check"),
    ] = None,
    since: Annotated[str, typer.Option(help="7d, 24h, or an ISO time")] = "7d",
    until: Annotated[str | None, typer.Option(help="end of the range; default now")] = None,
    step_s: Annotated[
        float, typer.Option(min=1.0, help="evaluate every this many seconds (1: as the scaler)")
    ] = 1.0,
    load_model: Annotated[
        LoadModel,
        typer.Option(
            help="utilization at a size the job did not run at: the same work spread over the"
            " GPUs (proportional) or the same utilization (same)"
        ),
    ] = LoadModel.proportional,
    chart: Annotated[
        Path | None, typer.Option("--chart", help="draw replicas (recorded and replayed) to a PNG")
    ] = None,
    output: OutputOpt = "table",
    no_headers: NoHeadersOpt = False,
) -> None:
    """Replay the job's recorded utilization and resizes under another policy."""
    out = output_option(output)
    lo = time_option("--since", since)
    hi = time_option("--until", until) or now_utc()
    assert lo is not None
    if lo >= hi:
        fail(Exit.USAGE, f"--since ({since}) must be before --until ({until})")
    if chart is not None:
        if importlib.util.find_spec("matplotlib") is None:
            fail(Exit.USAGE, "--chart needs matplotlib: pip install 'tide[demo]'")
        if chart.suffix.lower() != ".png":
            fail(Exit.USAGE, f"--chart: expected a .png file, got {str(chart)!r}")
    # Decisions of the day before count too: a cooldown or a resize may reach into the range.
    lookback = lo - timedelta(days=1)

    async def go(src: Any) -> tuple[Any, list[Any], list[Any], list[Any]]:
        j = await src.get_job(job)
        points = await src.utilization(job, lo, hi, seconds=True)
        decisions = sorted(
            await src.list_decisions(job, lookback, hi, ()),
            key=lambda d: (d.created_at.seconds, d.id),
        )
        if len(decisions) > MAX_DECISIONS:
            raise errors.InvalidArgument(
                f"{len(decisions)} decisions in the range; at most {MAX_DECISIONS}: narrow --since"
            )
        details = [await src.get_decision(d.id, 1) for d in decisions]
        return j, points, decisions, details

    j, points, decisions, details = conn.read(go)
    recs = [recorded(d, x) for d, x in zip(decisions, details, strict=True)]
    h = history(j, points, recs, lo.timestamp(), hi.timestamp())
    if not h.seconds:
        fail(Exit.NOT_FOUND, f"no utilization recorded for {job} between {iso(lo)} and {iso(hi)}")
    base = recorded_policy(j, details)
    model = load_model.value
    runs = [("as recorded", rp.replay(h, base, step_s=step_s, load_model=model))]
    if policy is not None:
        other = policy_file(policy, base)
        runs.append((policy.stem, rp.replay(h, other, step_s=step_s, load_model=model)))
    if chart is not None:
        from services.sim.chart import draw_replay

        try:
            draw_replay(h, runs, chart, points)
        except OSError as exc:
            fail(Exit.USAGE, f"--chart: cannot write {str(chart)!r}: {exc.strerror}")
    doc = rp.summary(h, runs)
    doc["since"], doc["until"] = iso(lo), iso(hi)
    if emit_document(render.document("tide.whatif", **clean(doc)), out):
        return
    recorded_s = sum(s.length_s for s in h.seconds)
    echo(
        f"{job}  {short(lo)} .. {short(hi)} UTC: {recorded_s:,.0f} s of utilization"
        f" recorded, {h.detail_s / recorded_s:.0%} of it second by second (minutes elsewhere)"
    )
    headers, rows = table(h, runs)
    print_table(headers, rows, no_headers=no_headers)
    real_h = rp.gpu_hours(rp.real_replicas(h), h.data_end_s, h.gpus_per_replica)
    echo(f"recorded: {real_h:.2f} GPU-hours")
    for name, r in runs:
        verdict = (
            "reproduces every recorded policy decision"
            if r.exact
            else f"{len(r.unmatched_real)} recorded policy decision(s) not reproduced"
            f" {r.unmatched_real}, {r.extra} decision(s) not recorded"
        )
        made = sum(1 for x in r.decisions if x.reason in rp.POLICY_REASONS)
        echo(f"{name}: {r.gpu_hours:.2f} GPU-hours, {made} policy decision(s); {verdict}")
    if chart is not None:
        echo(f"wrote {chart}")
