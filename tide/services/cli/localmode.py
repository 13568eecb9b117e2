"""Local mode: `tide up` (the control plane on this machine) and `tide demo`."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tide.base import errors
from tide.services.cli.app import Exit, echo, fail, run

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


InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="plaintext, unauthenticated links (default: mTLS with a CA made under STATE_DIR/pki)",
    ),
]
AdminTokenFileOpt = Annotated[
    Path | None,
    typer.Option(help="file holding an admin token the services then require on admin calls"),
]


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
    log_format: Annotated[
        str, typer.Option(help="services' and launchers' log lines: text or json")
    ] = "text",
    insecure: InsecureOpt = False,
    admin_token_file: AdminTokenFileOpt = None,
) -> None:
    """Run the scaler, the coordinator and optional synthetic agents here, until Ctrl-C."""
    from tide.services.local import up

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
            log_format=log_format,
            scaler_flags=up.split_flags(scaler_flag or []),
            tls=not insecure,
            admin_token_file=admin_token_file,
        )
    except errors.ConfigError as exc:
        fail(Exit.USAGE, str(exc))
    code = _run_until_signal(lambda stop: up.up(settings, echo, stop))
    raise typer.Exit(int(Exit.FAILED) if code else 0)


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
    log_format: Annotated[
        str, typer.Option(help="log lines under STATE_DIR/logs: text or json")
    ] = "text",
    insecure: InsecureOpt = False,
    admin_token_file: AdminTokenFileOpt = None,
    workload: Annotated[
        str,
        typer.Option(
            help="the example job: mlp (data parallel) or sharded (a fleet script, AdamW's"
            " state sharded over the ranks)"
        ),
    ] = "mlp",
) -> None:
    """Scale the example Paddle job 2 → 4 → 2 with synthetic GPU load, and prove nothing was lost."""
    for module, extra in (("paddle", "paddle-cpu"), ("matplotlib", "demo"), ("numpy", "trainer")):
        if importlib.util.find_spec(module) is None:
            fail(Exit.USAGE, f"tide demo needs {module}: pip install 'tide[{extra}]'")
    from tide.services.common import logs
    from tide.services.local import demo, view

    try:
        settings = demo.DemoSettings(
            state_dir=state_dir,
            cycles=cycles,
            hold_s=hold_s,
            timeout_s=timeout_s,
            sustain_s=sustain_s,
            cooldown_s=cooldown_s,
            chart=chart,
            log_format=log_format,
            tls=not insecure,
            admin_token_file=admin_token_file,
            workload=workload,
        )
    except errors.ConfigError as exc:
        fail(Exit.USAGE, str(exc))
    # The services log to STATE_DIR/logs; here only what needs a person's attention.
    logs.configure("WARNING")
    use_live = sys.stdout.isatty() if live is None else live

    async def go(stop: asyncio.Event) -> int:
        from rich.live import Live

        if use_live:
            from rich.console import Console

            out = Console()
            with Live(console=out, refresh_per_second=4, transient=False) as screen:
                d = demo.Demo(settings, lambda snap: screen.update(view.render(snap)), out.print)
                outcome = await d.run(stop)
        else:
            plain = view.PlainLines()

            def show(snap: view.Snapshot) -> None:
                for line in plain.lines(snap):
                    typer.echo(line)

            d = demo.Demo(settings, show, echo)
            outcome = await d.run(stop)
        for line in demo.summary_lines(outcome, settings.state_dir):
            typer.echo(line)
        return int(Exit.OK if outcome.ok else Exit.FAILED)

    raise typer.Exit(_run_until_signal(go))
