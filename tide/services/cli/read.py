"""The read commands: `tide jobs`, `tide history`, `tide explain`.

They read through the Scaler API or, with ``--db``, the scaler's store and its
converters (tide/services/cli/source.py), so both paths print the same thing. Each
takes ``-o table|wide|json|yaml|jsonpath=EXPR`` and ``--no-headers``
(tide/services/cli/output.py); `tide history -w` then follows new decision events.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from tide.services.cli import render
from tide.services.cli.app import Exit, console, fail, time_option
from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.output import (
    RICH_MAX_ROWS,
    NoHeadersOpt,
    Output,
    OutputOpt,
    PlainStream,
    csv_text,
    emit_document,
    parse_output,
    print_table,
)
from tide.services.cli.source import PAGE_SIZE, SQL_PAGE_SIZE
from tide.services.cli.timeparse import iso


def output_option(text: str, *, csv_ok: bool = False) -> Output:
    """``-o``'s value, or exit 2 with the accepted forms."""
    try:
        return parse_output(text, csv_ok=csv_ok)
    except ValueError as exc:
        fail(Exit.USAGE, f"--output: {exc}")


@connection_options(db=True)
def jobs_cmd(
    conn: Connection, output: OutputOpt = "table", no_headers: NoHeadersOpt = False
) -> None:
    """List the jobs the scaler manages: replicas, generation, utilization, autoscaling."""
    out = output_option(output)

    async def go(src: Any) -> list[Any]:
        jobs: list[Any] = await src.list_jobs()
        return jobs

    jobs = conn.read(go)
    offline = conn.offline
    doc = render.document(
        "tide.jobs",
        **render.jobs_envelope_fields(offline),
        jobs=[render.job_doc(j) for j in jobs],
    )
    if emit_document(doc, out):
        return
    if not jobs:
        typer.echo("no jobs", err=True)
        return
    print_table(*render.jobs_rows(jobs, offline=offline, wide=out.wide), no_headers=no_headers)
    if offline:
        typer.echo(render.OFFLINE_NOTE, err=True)


#: Decisions `tide history` shows unless told otherwise (kubectl-style: a first page
#: at once, then --limit N or --all).
DEFAULT_LIMIT = 100


@connection_options(db=True)
def history_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME; 'all' for every job")],
    since: Annotated[
        str, typer.Option(help="24h, 1h30m, 7d, or an ISO time (UTC if no zone)")
    ] = "24h",
    until: Annotated[
        str | None, typer.Option(help="end of the range (exclusive); default now")
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option("--state", help="only decisions in this state (repeat, or comma-separate)"),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(min=1, help="show at most this many decisions, newest first (see --all)"),
    ] = DEFAULT_LIMIT,
    all_: Annotated[
        bool,
        typer.Option(
            "--all", help="every decision in the range, printed page by page as they arrive"
        ),
    ] = False,
    chunk_size: Annotated[
        int,
        typer.Option(
            min=0,
            max=PAGE_SIZE,
            help=f"decisions fetched per ListDecisions call (0: {PAGE_SIZE};"
            f" with --db, {SQL_PAGE_SIZE} per read)",
        ),
    ] = 0,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch", "-w", help="then follow new decision events until Ctrl-C (not with --db)"
        ),
    ] = False,
    output: OutputOpt = "table",
    no_headers: NoHeadersOpt = False,
) -> None:
    """The job's scaling decisions, newest first (the newest --limit, or --all); with -w,
    then every change as it happens."""
    out = output_option(output, csv_ok=True)
    lo = time_option("--since", since)
    hi = time_option("--until", until)
    if lo is not None and hi is not None and lo >= hi:
        fail(Exit.USAGE, f"--since ({since}) must be before --until ({until})")
    if watch and conn.offline:
        fail(Exit.USAGE, "--watch follows the scaler's WatchDecisions; it cannot read --db")
    states: list[int] = []
    for item in state or []:
        for name in item.split(","):
            try:
                states.append(render.state_value(name))
            except ValueError:
                allowed = ", ".join(render.state_name(v) for v in range(1, 7))
                fail(Exit.USAGE, f"--state: unknown state {name!r} (one of {allowed})")
    job_id = "" if job == "all" else job
    want = None if all_ else limit

    if watch:
        from tide.services.cli.follow import follow_history

        async def everything(src: Any) -> list[Any]:
            if job_id:
                await src.get_job(job_id)
            decisions: list[Any] = await src.list_decisions(job_id, lo, hi, states)
            return decisions

        follow_history(conn, job_id, everything, out, no_headers=no_headers)
        return

    printer = HistoryPrinter(out, job_id=job_id, lo=lo, hi=hi, no_headers=no_headers)
    # A table is drawn from each source's rows as they come, converted once; the other
    # outputs need the decisions themselves.
    tabular = out.kind in ("table", "wide")

    async def go(src: Any) -> bool:
        if job_id:
            await src.get_job(job_id)  # an unknown job is an error, not an empty history

        # Through the API a page is at most PAGE_SIZE; the store itself reads more at once.
        chunk = chunk_size or (SQL_PAGE_SIZE if conn.offline else PAGE_SIZE)

        def page_size() -> int:
            return chunk if want is None else max(1, min(chunk, want - printer.count))

        # --all reads every page: the next may be asked for while one is printed.
        ahead = want is None
        pages = (
            src.history_table_pages(
                job_id, lo, hi, states, wide=out.wide, page_size=page_size, ahead=ahead
            )
            if tabular
            else src.decision_pages(job_id, lo, hi, states, page_size=page_size, ahead=ahead)
        )
        async for page, more in pages:
            room = len(page) if want is None else want - printer.count
            if tabular:
                printer.add_rows(page[:room])
            else:
                printer.add(page[:room])
            if want is not None and printer.count >= want:
                return more or len(page) > room
        return False

    with no_collector():
        cut = conn.read(go)
    printer.finish()
    if printer.count == 0 and out.tabular:
        typer.echo(f"no decisions for {job} since {iso(lo)}", err=True)
    elif cut and out.kind in ("table", "wide", "csv"):
        typer.echo(f"showing the newest {printer.count}; more with --limit N or --all", err=True)


@contextmanager
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off while the pages stream: each page's rows and
    cells are freed by their reference counts, and the collector's passes over them
    (set off by their allocations) found nothing to free and were a quarter of the
    CPU of 100,000 rows of `--db --all` (docs/cli.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def print_history(
    decisions: list[Any],
    out: Output,
    *,
    job_id: str,
    lo: Any = None,
    hi: Any = None,
    no_headers: bool = False,
) -> None:
    doc = render.document(
        "tide.history",
        job_id=job_id or None,
        since=iso(lo),
        until=iso(hi),
        decisions=[render.decision_doc(d) for d in decisions],
    )
    if emit_document(doc, out):
        return
    if out.kind == "csv":
        typer.echo(csv_text(render.CSV_COLUMNS, doc["decisions"]), nl=False)
    elif decisions:
        print_table(*render.history_rows(decisions, wide=out.wide), no_headers=no_headers)


class HistoryPrinter:
    """Prints `tide history` as its pages arrive. csv streams from the first page; a
    table is held (and drawn by rich on a terminal) until more than RICH_MAX_ROWS
    rows have come, then goes out plain, page by page, instead of waiting for the
    last page (a busy job has 20,000 decisions in 90 days). A document (json, yaml,
    jsonpath) is one value and is printed at the end."""

    def __init__(self, out: Output, *, job_id: str, lo: Any, hi: Any, no_headers: bool) -> None:
        self.out = out
        self.job_id = job_id
        self.lo = lo
        self.hi = hi
        self.no_headers = no_headers
        self.count = 0
        self.held: list[Any] = []
        self.held_rows: list[tuple[str, ...]] = []
        self.stream: PlainStream | None = None
        self.csv_started = False

    def add(self, decisions: list[Any]) -> None:
        """Decisions, for csv (streamed) and the documents (printed at the end)."""
        self.count += len(decisions)
        if self.out.kind == "csv":
            self._csv(decisions)
            return
        self.held.extend(decisions)

    def add_rows(self, rows: list[tuple[str, ...]]) -> None:
        """Table rows (``history_table_pages``): held for rich until more than
        RICH_MAX_ROWS have come, then printed plain as they arrive."""
        self.count += len(rows)
        if self.stream is None and self.count <= RICH_MAX_ROWS:
            self.held_rows.extend(rows)
            return
        if self.stream is None:
            self.stream = PlainStream(
                render.history_headers(wide=self.out.wide),
                no_headers=self.no_headers,
                free_text=render.HISTORY_FREE_TEXT,
            )
            rows, self.held_rows = [*self.held_rows, *rows], []
        self.stream.write(rows)

    def _csv(self, decisions: list[Any]) -> None:
        text = csv_text(render.CSV_COLUMNS, [render.decision_doc(d) for d in decisions])
        if self.csv_started:
            text = text.split("\n", 1)[1]
        self.csv_started = True
        typer.echo(text, nl=False)

    def finish(self) -> None:
        if self.out.kind == "csv":
            if not self.csv_started:
                self._csv([])
            return
        if self.stream is None and self.held_rows:
            print_table(
                render.history_headers(wide=self.out.wide),
                self.held_rows,
                no_headers=self.no_headers,
            )
        elif self.stream is None:
            print_history(
                self.held,
                self.out,
                job_id=self.job_id,
                lo=self.lo,
                hi=self.hi,
                no_headers=self.no_headers,
            )


@connection_options(db=True)
def explain_cmd(
    conn: Connection,
    decision_id: Annotated[int, typer.Argument(help="decision id (from `tide history`)", min=1)],
    context_minutes: Annotated[
        int, typer.Option(min=1, max=1440, help="minutes of utilization on each side")
    ] = 10,
    output: OutputOpt = "table",
) -> None:
    """Why a decision was made: its inputs, thresholds, state changes, pause, utilization."""
    out = output_option(output)

    async def go(src: Any) -> Any:
        return await src.get_decision(decision_id, context_minutes)

    detail = conn.read(go)
    if not emit_document(render.document("tide.explain", **render.explain_doc(detail)), out):
        render.print_explain(console(), detail)
