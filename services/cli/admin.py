"""The admin commands: `tide scale`, `tide pause`, `tide resume` (the scaler's admin calls,
with ``--token``)."""

from __future__ import annotations

import getpass
import os
from typing import Annotated

import typer

from services.cli import render
from services.cli.app import Exit, fail
from services.cli.connection import Connection, connection_options


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
) -> None:
    """Resize a job by hand, through the same coordinated path as the policy's."""
    why = _need_reason(reason)
    d = conn.call(lambda s: s.request_resize(job, replicas, why, requested_by or _who()))
    typer.echo(
        f"decision {d.id}: {d.job_id} {d.from_replicas} → {d.to_replicas} replicas"
        f" ({render.state_name(d.state)}); follow it with `tide explain {d.id}`"
    )


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
