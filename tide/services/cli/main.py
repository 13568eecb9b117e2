"""The `tide` command: operate the services and query the scaling history.

Exit codes, for every command: 0 ok, 1 not found, 2 bad usage or bad input,
3 server or database unreachable. A failure prints one line saying why.

The app and what commands share are in tide/services/cli/app.py, the connection
options in connection.py; each group of commands is a module: read.py (jobs,
history, explain), chart.py, whatif.py (replay history under another policy),
simulate.py (a simulated cluster), admin.py (scale, pause, resume), localmode.py
(up, demo), schema.py (db upgrade, downgrade), job.py (job apply), contexts.py
(config set-context, use-context, get-contexts, current-context); output.py is the
``-o`` of every read command, follow.py the WatchDecisions of ``history -w`` and
``scale --wait``. They are registered here, once.
"""

from __future__ import annotations

import signal
import sys

import typer

from tide.base import errors
from tide.services.cli import admin, chart, contexts, job, localmode, read, schema, simulate, whatif
from tide.services.cli.app import app, db_app, exit_code_of, job_app

# Every command, in the order `tide --help` lists them.
app.command("jobs")(read.jobs_cmd)
app.command("history")(read.history_cmd)
app.command("explain")(read.explain_cmd)
app.command("chart")(chart.chart_cmd)
app.command("whatif")(whatif.whatif_cmd)
app.command("simulate")(simulate.simulate_cmd)
app.command("scale")(admin.scale_cmd)
app.command("pause")(admin.pause_cmd)
app.command("resume")(admin.resume_cmd)
job_app.command("apply")(job.apply_cmd)
app.command("up")(localmode.up_cmd)
app.command("demo")(localmode.demo_cmd)
app.add_typer(contexts.config_app, name="config")
db_app.command("upgrade")(schema.db_upgrade)
db_app.command("downgrade")(schema.db_downgrade)

__all__ = ["app", "main"]


def main() -> None:
    # A process started with SIGINT ignored (a background job of a non-interactive shell:
    # CI, a test runner) would otherwise never stop on it; like kubectl, which takes the
    # signal back, Ctrl-C or `kill -INT` stops every command.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        app()
    except errors.TideError as exc:  # a command that did not catch its own
        typer.echo(f"tide: {' '.join(str(exc).split())}", err=True)
        sys.exit(int(exit_code_of(exc)))


if __name__ == "__main__":
    main()
