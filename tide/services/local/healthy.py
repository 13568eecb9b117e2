"""A healthy run of `tide up`, watched for noise (issue 32): two jobs, one resize each.

`tide up` runs as a user runs it (``python -m tide.services.cli up``, mTLS on every link, two
node agents with synthetic GPUs at one steady utilization, JSON logs). Two jobs of the
example trainer are written as local job specs and applied with ``tide job apply``; their
policies read that one utilization in opposite ways, so the scaler itself decides one
resize each and then has nothing more to do:

- ``healthy/grow``: 2 → 3 (the load is above its scale-up threshold; 3 is its max);
- ``healthy/shrink``: 2 → 1 (the load is below its scale-down threshold; 1 is its min).

It runs for ``duration_s`` of wall time (from the start of `tide up`; at least until
both resizes completed), stops `tide up` with SIGINT, then counts what a healthy run must
not have: WARNING and ERROR lines in every service's and launcher's log, `tide up`'s own
included (:mod:`tide.services.local.logscan`), and lost steps the coordinator recorded that the
trainers' sample logs show were not redone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from tide.base.client import open_channel
from tide.base.credentials import ClientCredentials
from tide.base.errors import ConfigError, FailedPrecondition
from tide.services.local.demo.report import state_name
from tide.services.local.demo.settings import DemoSettings
from tide.services.local.demo.spec import ROOT, job_spec
from tide.services.local.logscan import warnings_in
from tide.services.local.samples import audit
from tide.services.scaler.actuators.local import LocalActuator, LocalActuatorSettings, job_dir_name
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

logger = logging.getLogger(__name__)

PY = sys.executable
GROW, SHRINK = "healthy/grow", "healthy/shrink"
_RPC_TIMEOUT_S = 5.0
# "stopped agent-1 (0), agent-0 (0), scaler (0), coordinator (0)": tide up's last line.
_STOPPED = re.compile(r"(?P<name>[a-z0-9-]+) \((?P<code>-?\d+)\)")
_RETRIED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
# `tide up`'s own stderr, under STATE_DIR/logs: it logs nothing there when all is well.
UP_STDERR = "up.stderr"


@dataclass(frozen=True)
class HealthySettings:
    state_dir: Path
    # Wall time from `tide up`'s start to its SIGINT, seconds (longer if the resizes
    # take longer, up to resize_deadline_s).
    duration_s: float = 180.0
    # Both resizes must have completed this long after `tide up`'s start, seconds.
    resize_deadline_s: float = 180.0
    # The one utilization every synthetic GPU reports, percent.
    load_pct: float = 60.0
    # Policy windows: short, so that the resizes come early in the run.
    sustain_s: float = 6.0
    bucket_s: float = 2.0
    cooldown_s: float = 4.0
    # The example trainer's stand-in for heavier compute per step.
    step_delay_s: float = 0.05
    # SIGINT → exit of `tide up`, seconds.
    stop_timeout_s: float = 60.0
    poll_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("duration_s", "stop_timeout_s", "poll_interval_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.resize_deadline_s > 0:
            raise ConfigError(f"resize_deadline_s: must be > 0, got {self.resize_deadline_s}")
        # Both policies' bands must hold the load on the side that makes them resize.
        if not 55.0 <= self.load_pct <= 65.0:
            raise ConfigError(
                f"load_pct: must be 55..65 (the policies' bands), got {self.load_pct}"
            )


@dataclass
class HealthyOutcome:
    state_dir: Path
    up_rc: int | None = None
    elapsed_s: float = 0.0
    # job → its resizes (decision id, from, to, state), JOB_STARTED excluded.
    resizes: dict[str, list[tuple[int, int, int, str]]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    lost_steps_recorded: int = 0
    steps_redone: int = 0
    exactly_once: bool = False
    # Polls of the scaler that timed out (asked again at the next poll).
    polls_failed: int = 0
    # Each service's exit code as `tide up` printed it at its stop.
    stop_codes: dict[str, int] = field(default_factory=dict)
    error: str = ""

    @property
    def false_lost_steps(self) -> int:
        """Steps recorded as lost that no generation redid."""
        return max(0, self.lost_steps_recorded - self.steps_redone)

    @property
    def resized_once(self) -> bool:
        return all(
            len(r) == 1 and r[0][3] == "COMPLETED"
            for r in (self.resizes.get(GROW, []), self.resizes.get(SHRINK, []))
        )

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.up_rc == 0
            and self.resized_once
            and self.exactly_once
            and bool(self.stop_codes)
            and not any(self.stop_codes.values())
        )


def _policies(s: HealthySettings) -> dict[str, dict[str, Any]]:
    windows = {
        "sustain_s": s.sustain_s,
        "bucket_s": s.bucket_s,
        "cooldown_s": s.cooldown_s,
        "scale_down_stabilization_s": 0.0,
        "max_step": 1,
    }
    return {
        # 60 % is above 50: ceil(2 x 60 / 40) = 3, its max. CPU workers on a shared
        # machine rarely gain from a third: the goodput guard would revert the grow.
        GROW: {
            **windows,
            "scale_down_utilization_pct": 20.0,
            "target_utilization_pct": 40.0,
            "scale_up_utilization_pct": 50.0,
            "min_replicas": 2,
            "max_replicas": 3,
            "min_scale_up_efficiency": 0.0,
        },
        # 60 % is below 70: a shrink by one, to its min.
        SHRINK: {
            **windows,
            "scale_down_utilization_pct": 70.0,
            "target_utilization_pct": 80.0,
            "scale_up_utilization_pct": 95.0,
            "min_replicas": 1,
            "max_replicas": 2,
        },
    }


def _env() -> dict[str, str]:
    """This process's environment without a user's TIDE_* settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}


def admin_credentials(state_dir: Path) -> ClientCredentials:
    """The admin user's credentials `tide up` made under its state dir (and printed)."""
    pki = (state_dir / "pki").resolve()
    return ClientCredentials(
        tls_ca_file=str(pki / "ca.pem"),
        tls_client_cert_file=str(pki / "user-local-admin.pem"),
        tls_client_key_file=str(pki / "user-local-admin-key.pem"),
    )


class HealthyRun:
    def __init__(self, settings: HealthySettings, echo: Callable[[str], None]) -> None:
        self.s = settings
        self.echo = echo
        self.state = settings.state_dir.resolve()
        self.logs = self.state / "logs"
        self.demo = DemoSettings(state_dir=self.state, step_delay_s=settings.step_delay_s)
        # `tide up`'s stdout after READY.
        self.up_lines: list[str] = []
        self._drain_task: asyncio.Task[None] | None = None

    def _samples(self, job: str) -> Path:
        return self.state / "samples" / job_dir_name(job)

    def _write_specs(self) -> None:
        # The coordinator address is not used to write a spec.
        writer = LocalActuator(LocalActuatorSettings(self.state, "127.0.0.1:1"))
        for job in (GROW, SHRINK):
            ckpt = self.state / "checkpoints" / job_dir_name(job)
            self._samples(job).mkdir(parents=True, exist_ok=True)
            ckpt.mkdir(parents=True, exist_ok=True)
            writer.write_spec(job, job_spec(self.demo, self._samples(job), ckpt))

    def _tide(self, *args: str, stdin: str = "") -> None:
        creds = admin_credentials(self.state)
        r = subprocess.run(
            [PY, "-m", "tide.services.cli", *args],
            input=stdin,
            env={**_env(), **creds.env()},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise FailedPrecondition(f"tide {' '.join(args)}: exit {r.returncode}: {r.stderr}")

    async def run(self) -> HealthyOutcome:
        s = self.s
        out = HealthyOutcome(self.state)
        self.logs.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        up_log = open(self.logs / UP_STDERR, "ab")  # noqa: SIM115, ASYNC230 - the child's stderr
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "tide.services.cli", "up", "--state-dir", str(self.state),
            "--scaler-listen", "127.0.0.1:0", "--coordinator-listen", "127.0.0.1:0",
            "--agents", "2", "--gpus-per-agent", "4", "--load-pct", f"{s.load_pct:g}",
            "--log-format", "json",
            # Evaluate often and forget a stopped pod's GPUs soon, so the short windows act.
            "--scaler-flag", "--evaluate-interval-s 0.5 --stale-after-s 5",
            env={**_env(), "TIDE_LOG_FORMAT": "json"}, cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=up_log,
        )  # fmt: skip
        up_log.close()
        try:
            scaler = await self._ready(proc)
            self._write_specs()
            docs = [
                {"job_id": job, "initial_replicas": 2, "gpus_per_replica": 1, "policy": policy}
                for job, policy in _policies(s).items()
            ]
            await asyncio.to_thread(
                self._tide, "job", "apply", "--scaler", scaler, "-f", "-",
                stdin=yaml.safe_dump_all(docs),
            )  # fmt: skip
            self.echo(f"tide up ready ({scaler}); jobs {GROW} and {SHRINK} applied")
            await self._watch(scaler, out, t0, proc)
        except Exception as exc:
            out.error = str(exc) or type(exc).__name__
        finally:
            out.up_rc = await self._stop(proc)
            out.elapsed_s = round(time.monotonic() - t0, 1)
        self._account(out)
        return out

    async def _ready(self, proc: asyncio.subprocess.Process) -> str:
        assert proc.stdout is not None
        while True:
            line = (await proc.stdout.readline()).decode(errors="replace")
            if not line:
                raise FailedPrecondition(
                    f"tide up exited before READY (see {self.logs / UP_STDERR})"
                )
            if line.startswith("READY "):
                # Keep its stdout drained for the rest of the run; its last line names
                # each service's exit code.
                self._drain_task = asyncio.create_task(self._drain(proc))
                return line.split()[1].removeprefix("scaler=")

    async def _drain(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            self.up_lines.append(line.decode(errors="replace").rstrip())

    async def _watch(
        self, scaler: str, out: HealthyOutcome, t0: float, proc: asyncio.subprocess.Process
    ) -> None:
        s = self.s
        async with open_channel(scaler, credentials=admin_credentials(self.state)) as ch:
            stub: Any = scaler_pb2_grpc.ScalerStub(ch)
            while True:
                if proc.returncode is not None:
                    raise FailedPrecondition(f"tide up exited with code {proc.returncode}")
                for job in (GROW, SHRINK):
                    try:
                        resp = await stub.ListDecisions(
                            scaler_pb2.ListDecisionsRequest(job_id=job, page_size=100),
                            timeout=_RPC_TIMEOUT_S,
                        )
                    except grpc.aio.AioRpcError as exc:
                        # A poll that a starved machine answered late is asked again; the
                        # deadline below still bounds the run.
                        if exc.code() not in _RETRIED:
                            raise
                        out.polls_failed += 1
                        continue
                    out.resizes[job] = sorted(
                        (d.id, d.from_replicas, d.to_replicas, state_name(d.state))
                        for d in resp.decisions
                        if d.reason != common_pb2.DECISION_REASON_JOB_STARTED
                    )  # fmt: skip
                    for did, a, b, state in out.resizes[job]:
                        if state in ("ABORTED", "FAILED"):
                            raise FailedPrecondition(f"{job}: decision {did} {a} -> {b} {state}")
                now = time.monotonic() - t0
                if out.resized_once and now >= s.duration_s:
                    return
                if not out.resized_once and now >= s.resize_deadline_s:
                    raise FailedPrecondition(
                        f"not one completed resize per job within {s.resize_deadline_s:g} s:"
                        f" {out.resizes}"
                    )
                await asyncio.sleep(s.poll_interval_s)

    async def _stop(self, proc: asyncio.subprocess.Process) -> int | None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
        try:
            return await asyncio.wait_for(proc.wait(), self.s.stop_timeout_s)
        except TimeoutError:
            logger.error("tide up did not stop within %g s; killing it", self.s.stop_timeout_s)
            proc.kill()
            await proc.wait()
            return None
        finally:
            if self._drain_task is not None:
                await self._drain_task

    def _account(self, out: HealthyOutcome) -> None:
        out.warnings = warnings_in(self.logs, every_line=(UP_STDERR,))
        for line in self.up_lines:
            if line.startswith("stopped "):
                out.stop_codes = {
                    m["name"]: int(m["code"])
                    for m in _STOPPED.finditer(line.removeprefix("stopped "))
                }
        db = self.state / "tide.db"
        if db.exists():
            with contextlib.closing(sqlite3.connect(db)) as conn:
                rows = conn.execute(
                    "SELECT lost_steps_total FROM coordinator_jobs WHERE job_id IN (?, ?)",
                    (GROW, SHRINK),
                ).fetchall()
            out.lost_steps_recorded = sum(r[0] for r in rows)
        once = True
        for job in (GROW, SHRINK):
            if not self._samples(job).is_dir():
                once = False
                continue
            a = audit(
                self._samples(job),
                dataset_size=self.demo.dataset_size,
                global_batch=self.demo.global_batch,
                seed=self.demo.seed,
            )
            out.steps_redone += len(a.repeated_steps)
            once = once and a.exactly_once and a.last_step > 0
        out.exactly_once = once


def result(out: HealthyOutcome) -> dict[str, Any]:
    """The RESULT keys of bench.install for this run."""
    return {
        "warnings_in_healthy_run": len(out.warnings),
        "false_lost_steps": out.false_lost_steps,
        "healthy_resizes": {
            j: [f"{a}->{b} {st}" for _, a, b, st in r] for j, r in out.resizes.items()
        },
        "healthy_exactly_once": out.exactly_once,
        "healthy_elapsed_s": out.elapsed_s,
        "healthy_stop_codes": out.stop_codes,
        "healthy_polls_failed": out.polls_failed,
        "healthy_error": out.error or None,
    }


if (
    __name__ == "__main__"
):  # pragma: no cover - a manual look: python -m tide.services.local.healthy DIR
    o = asyncio.run(HealthyRun(HealthySettings(Path(sys.argv[1]), duration_s=0.0), print).run())
    print("\n".join(o.warnings))
    print(json.dumps(result(o)))
