"""`tide whatif JOB --policy FILE`: what another policy would have done with the job's own
history (tide/services/sim/replay.py): its decisions beside the real ones, and GPU-hours.

Without --policy it replays the policy the job really ran with: the self-check,
whose decisions must be the recorded ones."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from tide.base import errors
from tide.services.cli import render
from tide.services.cli.app import Exit, echo, fail, now_utc, time_option
from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.output import NoHeadersOpt, OutputOpt, emit_document, print_table
from tide.services.cli.read import output_option
from tide.services.cli.simulate import clean
from tide.services.cli.timeparse import iso, short


class LoadModel(StrEnum):
    proportional = "proportional"
    same = "same"


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
    from tide.services.cli.replaying import (
        MAX_DECISIONS,
        history,
        policy_file,
        recorded,
        recorded_policy,
        table,
    )
    from tide.services.sim import replay as rp

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
        from tide.services.sim.chart import draw_replay

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
