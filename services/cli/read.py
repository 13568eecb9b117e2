"""The read commands: `tide jobs`, `tide history`, `tide explain`.

They read through the Scaler API or, with ``--db``, the scaler's store and its
converters (services/cli/source.py), so both paths print the same thing.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from services.cli import render
from services.cli.app import DocOutput, Exit, Output, console, fail, time_option
from services.cli.connection import Connection, connection_options
from services.cli.timeparse import iso


@connection_options(db=True)
def jobs_cmd(
    conn: Connection,
    output: Annotated[DocOutput, typer.Option("--output", "-o")] = DocOutput.table,
) -> None:
    """List the jobs the scaler manages: replicas, generation, utilization, autoscaling."""

    async def go(src: Any) -> list[Any]:
        jobs: list[Any] = await src.list_jobs()
        return jobs

    jobs = conn.read(go)
    offline = conn.offline
    if output is DocOutput.json:
        typer.echo(
            render.envelope(
                "tide.jobs",
                **render.jobs_envelope_fields(offline),
                jobs=[render.job_doc(j) for j in jobs],
            )
        )
    elif not jobs:
        typer.echo("no jobs")
    else:
        console().print(render.jobs_table(jobs, offline=offline))
        if offline:
            typer.echo(render.OFFLINE_NOTE)


@connection_options(db=True)
def history_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME; 'all' for every job")],
    since: Annotated[str, typer.Option(help="24h, 7d, or an ISO time (UTC if no zone)")] = "24h",
    until: Annotated[
        str | None, typer.Option(help="end of the range (exclusive); default now")
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option("--state", help="only decisions in this state (repeat, or comma-separate)"),
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o")] = Output.table,
) -> None:
    """The job's scaling decisions, newest first."""
    lo = time_option("--since", since)
    hi = time_option("--until", until)
    if lo is not None and hi is not None and lo >= hi:
        fail(Exit.USAGE, f"--since ({since}) must be before --until ({until})")
    states: list[int] = []
    for item in state or []:
        for name in item.split(","):
            try:
                states.append(render.state_value(name))
            except ValueError:
                allowed = ", ".join(render.state_name(v) for v in range(1, 7))
                fail(Exit.USAGE, f"--state: unknown state {name!r} (one of {allowed})")
    job_id = "" if job == "all" else job

    async def go(src: Any) -> list[Any]:
        if job_id:
            await src.get_job(job_id)  # an unknown job is an error, not an empty history
        decisions: list[Any] = await src.list_decisions(job_id, lo, hi, states)
        return decisions

    decisions = conn.read(go)
    if output is Output.json:
        typer.echo(
            render.envelope(
                "tide.history",
                job_id=job_id or None,
                since=iso(lo),
                until=iso(hi),
                decisions=[render.decision_doc(d) for d in decisions],
            )
        )
    elif output is Output.csv:
        typer.echo(render.decisions_csv(decisions), nl=False)
    elif not decisions:
        typer.echo(f"no decisions for {job} since {iso(lo)}")
    else:
        console().print(render.history_table(decisions))


@connection_options(db=True)
def explain_cmd(
    conn: Connection,
    decision_id: Annotated[int, typer.Argument(help="decision id (from `tide history`)", min=1)],
    context_minutes: Annotated[
        int, typer.Option(min=1, max=1440, help="minutes of utilization on each side")
    ] = 10,
    output: Annotated[DocOutput, typer.Option("--output", "-o")] = DocOutput.table,
) -> None:
    """Why a decision was made: its inputs, thresholds, state changes, pause, utilization."""

    async def go(src: Any) -> Any:
        return await src.get_decision(decision_id, context_minutes)

    detail = conn.read(go)
    if output is DocOutput.json:
        typer.echo(render.envelope("tide.explain", **render.explain_doc(detail)))
    else:
        render.print_explain(console(), detail)
