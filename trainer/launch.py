"""``python -m trainer.launch``: the launcher's command line (the launcher is trainer/launcher/).

``python -m trainer.launch --coordinator HOST:PORT --job NS/NAME [--pod NAME] [--pod-index I]
[--host H] [--state-dir D] [--no-zygote] [--no-prewarm] -- python train.py ARGS``

One launcher per pod: it registers with the coordinator, holds the directive stream, and
starts, stops and steers the Paddle worker of each generation (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Sequence

from tidebase import logs
from tidebase.errors import ConfigError
from trainer.launcher import Launcher, LauncherSettings, State
from trainer.launcher.leave import LeaveOnSigterm

__all__ = ["Launcher", "LauncherSettings", "State", "main", "parse_args"]


def _default(name: str) -> object:
    """A LauncherSettings default, so that it is written once (in the dataclass)."""
    return next(f.default for f in dataclasses.fields(LauncherSettings) if f.name == name)


def parse_args(argv: Sequence[str] | None = None) -> LauncherSettings:
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m trainer.launch", description="the Tide launcher: one per pod"
    )
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--job", required=True, help="NAMESPACE/NAME of the job")
    p.add_argument("--pod", default=os.environ.get("POD_NAME", socket.gethostname()))
    # The Downward API's metadata.uid: the coordinator drains a preempted pod by it.
    p.add_argument("--pod-uid", default=os.environ.get("POD_UID", ""))
    p.add_argument("--pod-index", type=int, default=int(os.environ.get("TIDE_POD_INDEX", "0")))
    p.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    p.add_argument("--state-dir", default="", help="worker logs (default: a temp dir)")
    p.add_argument("--no-zygote", action="store_true", help="start fresh worker processes")
    p.add_argument("--no-prewarm", action="store_true", help="no worker waiting ahead of time")
    p.add_argument(
        "--exit-grace-s",
        type=float,
        default=_default("exit_grace_s"),
        help="how long a worker asked to exit gets before SIGKILL, seconds",
    )
    p.add_argument(
        "--leave-grace-s",
        type=float,
        default=float(os.environ.get("TIDE_LEAVE_GRACE_S", "0")),
        help="on SIGTERM, ask for a coordinated leave and wait this long for it, seconds"
        " (env TIDE_LEAVE_GRACE_S; 0: stop at once)",
    )
    p.add_argument("--log-level", default=os.environ.get("TIDE_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=os.environ.get("TIDE_LOG_FORMAT", "text"),
        help="text, or json with job_id and member as fields (env TIDE_LOG_FORMAT)",
    )
    ns = p.parse_args(args)
    logs.configure(ns.log_level, ns.log_format)
    # Every line of this launcher is about its job; the member id joins once registered.
    logs.bind_process(job_id=ns.job)
    return LauncherSettings(
        coordinator=ns.coordinator,
        job_id=ns.job,
        command=tuple(command),
        pod_name=ns.pod,
        pod_uid=ns.pod_uid,
        pod_index=ns.pod_index,
        host=ns.host,
        state_dir=ns.state_dir,
        use_zygote=not ns.no_zygote,
        prewarm=not ns.no_prewarm,
        exit_grace_s=ns.exit_grace_s,
        leave_grace_s=ns.leave_grace_s,
    )


async def _amain(settings: LauncherSettings) -> int:
    launcher = Launcher(settings)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, LeaveOnSigterm(launcher))
    loop.add_signal_handler(signal.SIGINT, launcher.stop, 0)
    return await launcher.run()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_amain(settings))


if __name__ == "__main__":
    raise SystemExit(main())
