"""Following decisions through WatchDecisions: `tide history -w` and `tide scale --wait`.

Both subscribe first and act second (list the history, request the resize), so no
change between the two can be missed: the scaler's first (empty) item on the stream
says it has subscribed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import typer

from tide.services.cli import render
from tide.services.cli.app import Exit, fail, run
from tide.services.cli.connection import Connection
from tide.services.cli.output import Output, jsonpath_values, plain_table, print_table
from tide.v1 import scaler_pb2

FINAL = render.FINAL_STATES


async def _subscribed(
    events: AsyncIterator[scaler_pb2.DecisionEvent],
) -> AsyncIterator[scaler_pb2.DecisionEvent]:
    await anext(events)  # the subscription mark
    return events


def print_event(e: scaler_pb2.DecisionEvent, out: Output) -> None:
    """One change: a table row (the decision as it is now, the change's detail as its
    message), or one document per event (json lines, yaml documents, jsonpath)."""
    if out.tabular:
        d = scaler_pb2.Decision()
        d.CopyFrom(e.decision)
        d.message = e.detail
        _, rows = render.history_rows([d], wide=out.wide)
        typer.echo(plain_table(rows[0], rows, no_headers=True), nl=False)
        return
    doc = render.event_doc_full(e)
    if out.kind == "json" or out.kind == "csv":
        typer.echo(json.dumps(doc))
    elif out.kind == "yaml":
        import yaml  # only -o yaml needs it: not a start-up cost of every command

        typer.echo("---\n" + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), nl=False)
    else:
        for value in jsonpath_values(doc, out.jsonpath):
            typer.echo(value)


def follow_history(
    conn: Connection,
    job_id: str,
    list_history: Callable[[Any], Awaitable[list[Any]]],
    out: Output,
    *,
    no_headers: bool,
) -> None:
    """The history, then each new event as it happens, until Ctrl-C (exit 0)."""
    from tide.services.cli.read import print_history

    async def go() -> None:
        async with conn.scaler_client() as s:
            events = await _subscribed(s.watch_decisions(job_id))
            decisions = await list_history(s)
            if out.tabular and not decisions:
                print_table(*render.history_rows([], wide=out.wide), no_headers=no_headers)
            else:
                print_history(decisions, out, job_id=job_id, no_headers=no_headers)
            async for e in events:
                print_event(e, out)
            fail(Exit.UNREACHABLE, "the scaler ended the watch (shutting down?)")

    run(go(), interrupted=Exit.OK)


def request_and_wait(
    conn: Connection,
    job: str,
    request: Callable[[Any], Awaitable[scaler_pb2.Decision]],
    wait_timeout_s: float,
    on_created: Callable[[scaler_pb2.Decision], None],
) -> scaler_pb2.Decision:
    """Make the request, then follow its decision to a final state; the final decision.
    Exit 5 when it is not final within ``wait_timeout_s``."""

    async def go() -> scaler_pb2.Decision:
        async with conn.scaler_client() as s:
            events = await _subscribed(s.watch_decisions(job))
            d = await request(s)
            on_created(d)
            if d.state in FINAL:
                return d

            async def final() -> scaler_pb2.Decision:
                async for e in events:
                    if e.decision_id == d.id:
                        typer.echo(
                            f"decision {d.id}: {render.state_name(e.state)}: {e.detail}",
                            err=True,
                        )
                        if e.state in FINAL:
                            return e.decision
                fail(Exit.UNREACHABLE, "the scaler ended the watch before the decision was final")

            try:
                return await asyncio.wait_for(final(), wait_timeout_s)
            except TimeoutError:
                fail(
                    Exit.DECISION_NOT_COMPLETED,
                    f"decision {d.id} is not final after {wait_timeout_s:g} s;"
                    f" follow it with `tide history {job} -w`",
                )

    return run(go())
