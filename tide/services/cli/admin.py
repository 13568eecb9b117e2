"""The admin commands: `tide scale`, `tide pause`, `tide resume` (the scaler's admin calls,
with ``--token``)."""

from __future__ import annotations

import getpass
import os
from typing import Annotated

import typer

from tide.services.cli import render
from tide.services.cli.app import Exit, duration_option, fail
from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.follow import request_and_wait
from tide.v1 import common_pb2, scaler_pb2


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER", "unknown")


def _need_reason(reason: str) -> str:
    if not reason.strip():
        fail(Exit.USAGE, "--reason must not be empty: it is stored with the decision")
    return reason.strip()


@connection_options(token=True)
def scale_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="target replicas")],
    reason: Annotated[str, typer.Option("--reason", help="why; stored with the decision")],
    requested_by: Annotated[
        str, typer.Option("--as", help="who asks (default: your user name)")
    ] = "",
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="follow the decision (WatchDecisions) until it is final; exit 5 unless COMPLETED",
        ),
    ] = False,
    wait_timeout: Annotated[
        str, typer.Option("--wait-timeout", help="with --wait: give up after this long (1h30m)")
    ] = "15m",
) -> None:
    """Resize a job by hand, through the same coordinated path as the policy's."""
    why = _need_reason(reason)
    who = requested_by or _who()

    def created(d: scaler_pb2.Decision) -> None:
        typer.echo(
            f"decision {d.id}: {d.job_id} {d.from_replicas} → {d.to_replicas} replicas"
            f" ({render.state_name(d.state)}); follow it with `tide explain {d.id}`"
        )

    if not wait:
        created(conn.call(lambda s: s.request_resize(job, replicas, why, who)))
        return
    limit_s = duration_option("--wait-timeout", wait_timeout)
    final = request_and_wait(
        conn, job, lambda s: s.request_resize(job, replicas, why, who), limit_s, created
    )
    state = render.state_name(final.state)
    detail = f"generation {final.generation}, pause {final.pause_s:.2f} s"
    if final.state != common_pb2.DECISION_STATE_COMPLETED:
        fail(Exit.DECISION_NOT_COMPLETED, f"decision {final.id} {state}: {final.error}")
    typer.echo(f"decision {final.id} {state}: {final.job_id} runs {final.to_replicas} ({detail})")


@connection_options(token=True)
def pause_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
    reason: Annotated[str, typer.Option("--reason", help="why; shown by `tide jobs`")],
) -> None:
    """Freeze autoscaling of a job (manual `tide scale` still works)."""
    why = _need_reason(reason)
    j = conn.call(lambda s: s.set_autoscaling(job, True, why))
    typer.echo(f"autoscaling of {j.job_id} paused: {j.pause_reason}")


@connection_options(token=True)
def resume_cmd(
    conn: Connection,
    job: Annotated[str, typer.Argument(help="NAMESPACE/NAME")],
) -> None:
    """Resume autoscaling of a job."""
    j = conn.call(lambda s: s.set_autoscaling(job, False, ""))
    typer.echo(f"autoscaling of {j.job_id} resumed")
