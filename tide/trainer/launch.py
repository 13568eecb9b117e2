"""``python -m tide.trainer.launch``: the launcher's command line (the launcher is tide/trainer/launcher/).

``python -m tide.trainer.launch --coordinator HOST:PORT --job NS/NAME [--pod NAME] [--pod-index I]
[--host H] [--state-dir D] [--no-zygote] [--no-prewarm] [--backend auto|nccl|gloo]
[--workers-per-pod N] -- python train.py ARGS``, or ``paddle.distributed.launch``'s form
(``--nnodes 2:4 --nproc_per_node 1 --job_id NAME train.py ARGS``: no ``--``;
tide/trainer/integrations/paddle_launch.py translates it, refusing what Tide cannot honour).

In a PaddleJob pod the flags come from the environment (TIDE_COORDINATOR, the
Downward API's POD_NAME, POD_NAMESPACE and POD_IP: tide/trainer/podenv.py), so the
worker container's args are just ``-- python train.py ARGS``. SIGTERM (the
kubelet stopping the pod) stops the worker and exits 0.

One launcher per pod: it registers with the coordinator, holds the directive stream, and
starts, stops and steers the Paddle worker of each generation (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from tide.base import logs
from tide.base.credentials import (
    ENV_TLS_CA_FILE,
    ENV_TLS_CLIENT_CERT_FILE,
    ENV_TLS_CLIENT_KEY_FILE,
    ENV_TOKEN_FILE,
    ClientCredentials,
)
from tide.base.errors import ConfigError
from tide.trainer.devices import Backend
from tide.trainer.integrations import paddle_launch
from tide.trainer.launcher import Launcher, LauncherSettings, State
from tide.trainer.launcher.leave import LeaveOnSigterm
from tide.trainer.podenv import pod_identity

logger = logging.getLogger(__name__)

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
        prog="python -m tide.trainer.launch",
        description="the Tide launcher: one per pod",
        epilog="paddle.distributed.launch's form is accepted too (no --: FLAGS train.py ARGS,"
        " e.g. --nnodes 2:4 --nproc_per_node 1 --job_id NAME); docs/migrate.md maps its flags",
    )
    # In a PaddleJob pod everything below comes from the environment (tide/trainer/podenv.py).
    pod = pod_identity(os.environ, socket.gethostname())
    coordinator = os.environ.get("TIDE_COORDINATOR", "")
    p.add_argument(
        "--coordinator",
        required=not coordinator,
        default=coordinator,
        help="HOST:PORT of the coordinator, or IP:PORT,IP:PORT... of its replicas"
        " (the leader is the one whose health is SERVING; env TIDE_COORDINATOR)",
    )
    p.add_argument(
        "--job",
        required=not pod.job_id,
        default=pod.job_id,
        help="NAMESPACE/NAME of the job (env TIDE_JOB, else POD_NAMESPACE and the pod's name)",
    )
    p.add_argument("--pod", default=pod.pod_name, help="this pod's name (env POD_NAME)")
    p.add_argument(
        "--pod-index",
        type=int,
        default=pod.pod_index if pod.pod_index is not None else 0,
        help="this pod's index (env TIDE_POD_INDEX, PADDLE_TRAINER_ID, or NAME-worker-INDEX)",
    )
    # The Downward API's metadata.uid: the coordinator drains a preempted pod by it.
    p.add_argument("--pod-uid", default=os.environ.get("POD_UID", ""))
    p.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    p.add_argument("--state-dir", default="", help="worker logs (default: a temp dir)")
    p.add_argument("--no-zygote", action="store_true", help="start fresh worker processes")
    p.add_argument("--no-prewarm", action="store_true", help="no worker waiting ahead of time")
    p.add_argument(
        "--no-handover",
        action="store_true",
        help="no state handed over in shared memory: every restart reads the durable store",
    )
    p.add_argument(
        "--exit-grace-s",
        type=float,
        default=_default("exit_grace_s"),
        help="how long a worker asked to exit gets before SIGKILL, seconds",
    )
    for flag, env, what in (
        ("--tls-ca-file", ENV_TLS_CA_FILE, "CA (PEM) the coordinator's certificate chains to"),
        ("--tls-client-cert-file", ENV_TLS_CLIENT_CERT_FILE, "client certificate (PEM), mTLS"),
        ("--tls-client-key-file", ENV_TLS_CLIENT_KEY_FILE, "client key (PEM), mTLS"),
        ("--token-file", ENV_TOKEN_FILE, "bearer token file, re-read on change"),
    ):
        p.add_argument(flag, default=os.environ.get(env, ""), help=f"{what} (env {env})")
    p.add_argument(
        "--backend",
        choices=[b.value for b in Backend],
        default=os.environ.get("TIDE_BACKEND", _default("backend")),
        help="collective backend: auto is nccl when the pod has GPUs, else gloo (env TIDE_BACKEND)",
    )
    p.add_argument(
        "--workers-per-pod",
        type=int,
        default=int(os.environ.get("TIDE_WORKERS_PER_POD", str(_default("workers_per_pod")))),
        help="workers in this pod; 0: one per GPU, or one on CPU (env TIDE_WORKERS_PER_POD)",
    )
    p.add_argument(
        "--leave-grace-s",
        type=float,
        default=float(os.environ.get("TIDE_LEAVE_GRACE_S", "0")),
        help="on SIGTERM, ask for a coordinated leave and wait this long for it, seconds"
        " (env TIDE_LEAVE_GRACE_S; 0: stop at once)",
    )
    p.add_argument(
        "--prepare-min-free-mib",
        type=int,
        default=int(
            os.environ.get("TIDE_PREPARE_MIN_FREE_MIB", str(_default("prepare_min_free_mib")))
        ),
        help="overlap mode on GPUs: nack a PREPARE unless every GPU of the pod has this much"
        " memory free, MiB (env TIDE_PREPARE_MIN_FREE_MIB; 0: no check)",
    )
    p.add_argument(
        "--final-report-timeout-s",
        type=float,
        default=float(
            os.environ.get("TIDE_FINAL_REPORT_TIMEOUT_S", str(_default("final_report_timeout_s")))
        ),
        help="once training finished, keep reporting it until the coordinator recorded it, at"
        " most this long, seconds: longer than a store outage the coordinator rides out"
        " (env TIDE_FINAL_REPORT_TIMEOUT_S)",
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
        handover=not ns.no_handover,
        exit_grace_s=ns.exit_grace_s,
        prepare_min_free_mib=ns.prepare_min_free_mib,
        credentials=ClientCredentials.of(ns),
        backend=ns.backend,
        workers_per_pod=ns.workers_per_pod,
        leave_grace_s=ns.leave_grace_s,
        final_report_timeout_s=ns.final_report_timeout_s,
    )


async def _amain(settings: LauncherSettings) -> int:
    loop = asyncio.get_running_loop()
    # Taken before the launcher is built (it logs as it is): a SIGTERM meanwhile waits on the
    # loop, and reaches the handler set below, not the default action (exit -15).
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    launcher = Launcher(settings)
    loop.add_signal_handler(signal.SIGTERM, LeaveOnSigterm(launcher))
    loop.add_signal_handler(signal.SIGINT, launcher.stop, 0)
    return await launcher.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    compat = None
    try:
        if paddle_launch.is_paddle_style(args):
            # `python -m paddle.distributed.launch`'s flags (tide/trainer/integrations/paddle_launch.py).
            compat = paddle_launch.translate(args)
            os.environ.update(compat.env)
            args = list(compat.argv)
        settings = parse_args(args)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if compat is not None and compat.print_job:
        print(compat.job_document(settings.job_id), end="")
        return 0
    if compat is not None and compat.min_replicas is not None:
        logger.info(
            "--nnodes %s:%s: the job's bounds are the scaler's; --print-job prints the"
            " `tide job apply` document that sets them",
            compat.min_replicas,
            compat.max_replicas,
        )
    return asyncio.run(_amain(settings))


if __name__ == "__main__":
    raise SystemExit(main())
