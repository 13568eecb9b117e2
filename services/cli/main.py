"""The `tide` command: operate the services and query the scaling history.

Exit codes, for every command: 0 ok, 1 not found, 2 bad usage or bad input,
3 server or database unreachable. A failure prints one line saying why.
"""

from __future__ import annotations

import asyncio
import getpass
import importlib.util
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from services.cli import render
from services.cli.source import GrpcScaler, SqlHistory
from services.cli.timeparse import iso, parse_time
from tidebase import errors

T = TypeVar("T")


class Exit(IntEnum):
    OK = 0
    NOT_FOUND = 1
    USAGE = 2
    UNREACHABLE = 3


app = typer.Typer(
    name="tide",
    help="Tide: elastic training for PaddlePaddle. Operate the services, read the scaling history.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")

DEFAULT_DB = "sqlite:///.tide/tide.db"


def fail(code: Exit, message: str) -> NoReturn:
    """Print one line to stderr and exit with ``code``."""
    # Driver errors (psycopg's) span lines; the convention is one line per failure.
    typer.echo(f"tide: {' '.join(message.split())}", err=True)
    raise typer.Exit(int(code))


def exit_code_of(exc: errors.TideError) -> Exit:
    if isinstance(exc, errors.NotFound):
        return Exit.NOT_FOUND
    if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)):
        return Exit.UNREACHABLE
    return Exit.USAGE


@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[str, typer.Option("--db", envvar="TIDE_DB", help="SQLAlchemy URL")] = DEFAULT_DB,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Upgrade the schema to the latest (or the given) revision."""
    from services.store import db as store

    try:
        store.upgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="target revision, e.g. base")],
    db: Annotated[str, typer.Option("--db", envvar="TIDE_DB", help="SQLAlchemy URL")] = DEFAULT_DB,
) -> None:
    """Downgrade the schema (destroys data of the dropped tables)."""
    from services.store import db as store

    try:
        store.downgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


# --- connection options, shared by the commands that talk to the scaler ---------------------

DEFAULT_SCALER = "127.0.0.1:50051"

ScalerOpt = Annotated[
    str, typer.Option("--scaler", envvar="TIDE_SCALER", help="scaler gRPC address HOST:PORT")
]
DbOpt = Annotated[
    str,
    typer.Option(
        "--db",
        help="read the SQL store at this SQLAlchemy URL instead of asking the scaler (offline)",
    ),
]
TokenOpt = Annotated[
    str,
    typer.Option(
        "--token", envvar="TIDE_ADMIN_TOKEN", help="admin bearer token", show_default=False
    ),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout-s", min=0.1, help="deadline of each call")]
CaOpt = Annotated[str, typer.Option("--ca-file", envvar="TIDE_CA_FILE", help="CA (PEM): use TLS")]
CertOpt = Annotated[
    str, typer.Option("--cert-file", envvar="TIDE_CERT_FILE", help="client certificate (mTLS)")
]
KeyOpt = Annotated[
    str, typer.Option("--key-file", envvar="TIDE_KEY_FILE", help="client key (mTLS)")
]


class Output(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


class DocOutput(StrEnum):
    table = "table"
    json = "json"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one command's coroutine; a TideError becomes its exit code and one line."""
    try:
        return asyncio.run(coro)
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


def scaler_client(
    scaler: str, *, token: str = "", timeout_s: float, ca: str, cert: str, key: str
) -> GrpcScaler:
    return GrpcScaler(
        scaler, token=token, timeout_s=timeout_s, ca_file=ca, cert_file=cert, key_file=key
    )


def call_scaler(
    scaler: str,
    call: Callable[[GrpcScaler], Awaitable[T]],
    *,
    token: str = "",
    timeout_s: float,
    ca: str,
    cert: str,
    key: str,
) -> T:
    """Connect to the scaler, make one call, and close: the admin commands' whole I/O."""

    async def go() -> T:
        async with scaler_client(
            scaler, token=token, timeout_s=timeout_s, ca=ca, cert=cert, key=key
        ) as s:
            return await call(s)

    return run(go())


def history_source(
    db: str, scaler: str, *, timeout_s: float, ca: str, cert: str, key: str
) -> GrpcScaler | SqlHistory:
    if db:
        return SqlHistory(db)
    return scaler_client(scaler, timeout_s=timeout_s, ca=ca, cert=cert, key=key)


def console() -> Console:
    # Piped output keeps whole rows: a pager or grep should not see folded cells.
    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def now_utc() -> datetime:
    return datetime.now(tz=UTC)


def _time_option(name: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_time(text, now_utc())
    except errors.InvalidArgument as exc:
        fail(Exit.USAGE, f"{name}: {exc}")


# --- read commands --------------------------------------------------------------------------


@app.command("jobs")
def jobs_cmd(
    scaler: ScalerOpt = DEFAULT_SCALER,
    db: DbOpt = "",
    output: Annotated[DocOutput, typer.Option("--output", "-o")] = DocOutput.table,
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """List the jobs the scaler manages: replicas, generation, utilization, autoscaling."""

    async def go() -> list[Any]:
        async with history_source(
            db, scaler, timeout_s=timeout_s, ca=ca_file, cert=cert_file, key=key_file
        ) as src:
            return await src.list_jobs()

    jobs = run(go())
    offline = bool(db)
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


@app.command("history")
def history_cmd(
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
    scaler: ScalerOpt = DEFAULT_SCALER,
    db: DbOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """The job's scaling decisions, newest first."""
    lo = _time_option("--since", since)
    hi = _time_option("--until", until)
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

    async def go() -> list[Any]:
        async with history_source(
            db, scaler, timeout_s=timeout_s, ca=ca_file, cert=cert_file, key=key_file
        ) as src:
            if job_id:
                await src.get_job(job_id)  # an unknown job is an error, not an empty history
            return await src.list_decisions(job_id, lo, hi, states)

    decisions = run(go())
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


@app.command("explain")
def explain_cmd(
    decision_id: Annotated[int, typer.Argument(help="decision id (from `tide history`)", min=1)],
    context_minutes: Annotated[
        int, typer.Option(min=1, max=1440, help="minutes of utilization on each side")
    ] = 10,
    output: Annotated[DocOutput, typer.Option("--output", "-o")] = DocOutput.table,
    scaler: ScalerOpt = DEFAULT_SCALER,
    db: DbOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """Why a decision was made: its inputs, thresholds, state changes, pause, utilization."""

    async def go() -> Any:
        async with history_source(
            db, scaler, timeout_s=timeout_s, ca=ca_file, cert=cert_file, key=key_file
        ) as src:
            return await src.get_decision(decision_id, context_minutes)

    detail = run(go())
    if output is DocOutput.json:
        typer.echo(render.envelope("tide.explain", **render.explain_doc(detail)))
    else:
        render.print_explain(console(), detail)


@app.command("chart")
def chart_cmd(
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    out: Annotated[Path, typer.Option("--out", help="PNG file to write")],
    since: Annotated[str, typer.Option(help="24h, 7d, or an ISO time")] = "24h",
    until: Annotated[str | None, typer.Option(help="end of the range; default now")] = None,
    scaler: ScalerOpt = DEFAULT_SCALER,
    db: DbOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """Draw utilization, replicas and decision markers of a job to a PNG."""
    if importlib.util.find_spec("matplotlib") is None:
        fail(Exit.USAGE, "tide chart needs matplotlib: pip install 'tide[demo]'")
    from services.cli import chart
    from services.local.chart import draw

    lo = _time_option("--since", since)
    hi = _time_option("--until", until) or now_utc()
    assert lo is not None  # since always has a value
    if lo >= hi:
        fail(Exit.USAGE, f"--since ({since}) must be before --until ({until})")
    if out.suffix.lower() != ".png":
        fail(Exit.USAGE, f"--out: expected a .png file, got {str(out)!r}")

    async def go() -> tuple[Any, list[Any], list[Any]]:
        async with history_source(
            db, scaler, timeout_s=timeout_s, ca=ca_file, cert=cert_file, key=key_file
        ) as src:
            j = await src.get_job(job)
            return j, await src.utilization(job, lo, hi), await src.list_decisions(job, lo, hi, ())

    j, points, decisions = run(go())
    series = chart.series_from_history(points, decisions)
    try:
        draw(
            series,
            out,
            title=f"{job}  {iso(lo)} .. {iso(hi)}",
            scale_up_pct=j.policy.scale_up_utilization_pct or None,
            scale_down_pct=j.policy.scale_down_utilization_pct or None,
        )
    except OSError as exc:
        fail(Exit.USAGE, f"--out: cannot write {str(out)!r}: {exc.strerror}")
    typer.echo(f"wrote {out} ({len(points)} minutes, {len(decisions)} decisions)")


# --- admin commands -------------------------------------------------------------------------


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER", "unknown")


def _need_reason(reason: str) -> str:
    if not reason.strip():
        fail(Exit.USAGE, "--reason must not be empty: it is stored with the decision")
    return reason.strip()


@app.command("scale")
def scale_cmd(
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="target replicas")],
    reason: Annotated[str, typer.Option("--reason", help="why; stored with the decision")],
    requested_by: Annotated[
        str, typer.Option("--as", help="who asks (default: your user name)")
    ] = "",
    scaler: ScalerOpt = DEFAULT_SCALER,
    token: TokenOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """Resize a job by hand, through the same coordinated path as the policy's."""
    why = _need_reason(reason)

    d = call_scaler(
        scaler,
        lambda s: s.request_resize(job, replicas, why, requested_by or _who()),
        token=token,
        timeout_s=timeout_s,
        ca=ca_file,
        cert=cert_file,
        key=key_file,
    )
    typer.echo(
        f"decision {d.id}: {d.job_id} {d.from_replicas} → {d.to_replicas} replicas"
        f" ({render.state_name(d.state)}); follow it with `tide explain {d.id}`"
    )


@app.command("pause")
def pause_cmd(
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    reason: Annotated[str, typer.Option("--reason", help="why; shown by `tide jobs`")],
    scaler: ScalerOpt = DEFAULT_SCALER,
    token: TokenOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """Freeze autoscaling of a job (manual `tide scale` still works)."""
    why = _need_reason(reason)

    j = call_scaler(
        scaler,
        lambda s: s.set_autoscaling(job, True, why),
        token=token,
        timeout_s=timeout_s,
        ca=ca_file,
        cert=cert_file,
        key=key_file,
    )
    typer.echo(f"autoscaling of {j.job_id} paused: {j.pause_reason}")


@app.command("resume")
def resume_cmd(
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    scaler: ScalerOpt = DEFAULT_SCALER,
    token: TokenOpt = "",
    timeout_s: TimeoutOpt = 5.0,
    ca_file: CaOpt = "",
    cert_file: CertOpt = "",
    key_file: KeyOpt = "",
) -> None:
    """Resume autoscaling of a job."""

    j = call_scaler(
        scaler,
        lambda s: s.set_autoscaling(job, False, ""),
        token=token,
        timeout_s=timeout_s,
        ca=ca_file,
        cert=cert_file,
        key=key_file,
    )
    typer.echo(f"autoscaling of {j.job_id} resumed")


# --- local control plane --------------------------------------------------------------------


StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="SQLite store, logs, pods and checkpoints live here")
]


def _run_until_signal(make: Any) -> int:
    """Run ``make(stop_event)`` with SIGINT/SIGTERM setting the event; its int is the exit code."""
    import signal

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        code: int = await make(stop)
        return code

    return run(go())


@app.command("up")
def up_cmd(
    state_dir: StateDirOpt = Path(".tide"),
    scaler_listen: Annotated[str, typer.Option(help="scaler gRPC address")] = "127.0.0.1:50051",
    coordinator_listen: Annotated[
        str, typer.Option(help="coordinator gRPC address")
    ] = "127.0.0.1:50052",
    agents: Annotated[int, typer.Option(min=0, max=16, help="node agents with synthetic GPUs")] = 0,
    gpus_per_agent: Annotated[int, typer.Option(min=1, max=64)] = 4,
    load_pct: Annotated[
        float, typer.Option(min=0, max=100, help="utilization the agents' synthetic GPUs report")
    ] = 50.0,
    total_gpus: Annotated[
        int, typer.Option(min=0, help="GPUs local jobs may hold; 0: no limit")
    ] = 0,
    scaler_flag: Annotated[
        list[str] | None,
        typer.Option(help="extra scaler flags, e.g. --scaler-flag '--sustain-s 10' (repeat)"),
    ] = None,
    log_level: Annotated[str, typer.Option(help="services' log level")] = "INFO",
) -> None:
    """Run the scaler, the coordinator and optional synthetic agents here, until Ctrl-C."""
    from services.local import up

    try:
        settings = up.UpSettings(
            state_dir=state_dir,
            scaler_listen=scaler_listen,
            coordinator_listen=coordinator_listen,
            agents=agents,
            gpus_per_agent=gpus_per_agent,
            load_pct=load_pct,
            total_gpus=total_gpus,
            log_level=log_level,
            scaler_flags=up.split_flags(scaler_flag or []),
        )
    except errors.ConfigError as exc:
        fail(Exit.USAGE, str(exc))
    code = _run_until_signal(lambda stop: up.up(settings, _echo, stop))
    raise typer.Exit(code)


def _echo(line: str) -> None:
    typer.echo(line)


@app.command("demo")
def demo_cmd(
    state_dir: StateDirOpt = Path(".tide"),
    cycles: Annotated[int, typer.Option(min=1, max=20, help="high/low load cycles")] = 1,
    hold_s: Annotated[
        float, typer.Option(min=0, help="stay this long at each size once reached, seconds")
    ] = 0.0,
    timeout_s: Annotated[
        float, typer.Option(min=10, help="give up after this long, seconds")
    ] = 170.0,
    sustain_s: Annotated[float, typer.Option(min=1, help="policy sustain window, seconds")] = 10.0,
    cooldown_s: Annotated[float, typer.Option(min=0, help="policy cooldown, seconds")] = 10.0,
    chart: Annotated[
        Path | None, typer.Option(help="PNG to write (default STATE_DIR/demo.png)")
    ] = None,
    live: Annotated[
        bool | None,
        typer.Option("--live/--plain", help="live view or plain lines (default: live on a tty)"),
    ] = None,
) -> None:
    """Scale the example Paddle job 2 → 4 → 2 with synthetic GPU load, and prove nothing was lost."""
    for module, extra in (("paddle", "paddle-cpu"), ("matplotlib", "demo"), ("numpy", "trainer")):
        if importlib.util.find_spec(module) is None:
            fail(Exit.USAGE, f"tide demo needs {module}: pip install 'tide[{extra}]'")
    from services.common import logs
    from services.local import demo, view

    try:
        settings = demo.DemoSettings(
            state_dir=state_dir,
            cycles=cycles,
            hold_s=hold_s,
            timeout_s=timeout_s,
            sustain_s=sustain_s,
            cooldown_s=cooldown_s,
            chart=chart,
        )
    except errors.ConfigError as exc:
        fail(Exit.USAGE, str(exc))
    # The services log to STATE_DIR/logs; here only what needs a person's attention.
    logs.configure("WARNING")
    use_live = sys.stdout.isatty() if live is None else live

    async def go(stop: asyncio.Event) -> int:
        from rich.live import Live

        if use_live:
            out = Console()
            with Live(console=out, refresh_per_second=4, transient=False) as screen:
                d = demo.Demo(settings, lambda snap: screen.update(view.render(snap)), out.print)
                outcome = await d.run(stop)
        else:
            plain = view.PlainLines()

            def show(snap: view.Snapshot) -> None:
                for line in plain.lines(snap):
                    typer.echo(line)

            d = demo.Demo(settings, show, _echo)
            outcome = await d.run(stop)
        for line in demo.summary_lines(outcome, settings.state_dir):
            typer.echo(line)
        return 0 if outcome.ok else 1

    raise typer.Exit(_run_until_signal(go))


def main() -> None:
    try:
        app()
    except errors.TideError as exc:  # a command that did not catch its own
        typer.echo(f"tide: {' '.join(str(exc).split())}", err=True)
        sys.exit(int(exit_code_of(exc)))


if __name__ == "__main__":
    main()
