"""A platform team's first contact with the chart (issue 32), measured on this machine.

What it runs, all with mTLS:

- ``launcher_without_ca_exit_s`` / ``launcher_without_ca_rc``: a real launcher
  (``python -m tide.trainer.launch``) dialling an mTLS coordinator without a CA exits, with
  one line naming the cause; the seconds from its start to its exit, and its status.
- ``cli_in_pod_rc``: the CLI with exactly the environment the chart renders for the
  scaler's container (``helm template`` of values-small.yaml: TIDE_SCALER,
  TIDE_TLS_CA_FILE, TIDE_TLS_SERVER_NAME, ...) against a scaler whose certificate names
  only the Service (``tide-scaler``, ``tide-scaler.tide-system.svc``), as
  ``kubectl exec deploy/tide-scaler -- tide jobs`` would run. The pod's identity is
  presented as the scaler's client certificate (no TokenReview API here; the chart's
  pod presents the same identity as a token).
- ``cli_port_forward_rc``: the CLI on 127.0.0.1 against that certificate with
  ``--tls-server-name tide-scaler`` (a port-forward); ``..._without_name_rc`` without it
  (2, a TLS cause named).

- ``warnings_in_healthy_run`` and ``false_lost_steps``: ``tide up`` (mTLS, two
  synthetic node agents at one steady utilization) for ``--duration-s`` (180, the
  issue's 3 minutes) with two jobs of the example trainer applied by ``tide job apply``,
  each resized once by the scaler (``healthy/grow`` 2 -> 3, ``healthy/shrink`` 2 -> 1:
  tide/services/local/healthy.py), then stopped with SIGINT: the WARNING and ERROR lines of
  every service and launcher log and of `tide up`'s own stderr
  (tide/services/local/logscan.py), and the steps the coordinator recorded as lost that
  the trainers' sample logs show no generation redid. The run itself must be sound
  (each job's resize COMPLETED, every sample consumed exactly once, `tide up` exit 0),
  or the bench exits with the reason; ``healthy_*`` keys say what it did.

- ``rendered_pods_started``: the chart's own Deployment and DaemonSet pods (``helm
  template`` of values-small.yaml applied with kubectl) started and Ready in their
  sandboxes on the emulated cluster with TLS, TokenReview and an HTTPS API server
  (tide/services/testing/kube/chartrun.py); ``example_resized``: 1 when the shipped example
  PaddleJob was then resized 2 -> 3 -> 2 by ``tide scale`` run in the scaler's pod, else 0
  (``chart_error`` says why). Null where the sandboxes cannot run (not root, no unshare)
  or helm/kubectl are missing.

    python -m bench.install --quick

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tide.base.listening import parse_listening
from tide.services.common.pki import CertificateAuthority
from tide.services.local.healthy import HealthyRun, HealthySettings
from tide.services.local.healthy import result as healthy_result
from tide.services.testing.kube.chartrun import ChartRun
from tide.services.testing.kube.sandbox import Sandboxes
from tide.services.testing.stack import start_stack

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SERVICE_NAMES = ("tide-scaler", "tide-scaler.tide-system.svc")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}


async def launcher_without_ca(workdir: Path) -> tuple[float, int]:
    stack = await start_stack(workdir / "stack")
    try:
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "tide.trainer.launch", f"--coordinator={stack.coordinator_target}",
            "--job=ml-research/resnet", "--pod=resnet-worker-0",
            f"--state-dir={workdir / 'launcher'}", "--", PY, "-c", "pass",
            env=_clean_env(), cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            rc = await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return 60.0, 0
        return round(time.monotonic() - t0, 2), rc
    finally:
        await stack.close()


def _helm() -> Path | None:
    found = shutil.which("helm")
    cached = ROOT / ".venv" / "kubetools" / "helm"
    return Path(found) if found else (cached if cached.exists() else None)


def scaler_pod_env(ca_file: str) -> dict[str, str] | None:
    """The scaler container's TIDE_* environment as the chart renders it (values-small),
    its files moved to ``ca_file``; None without helm."""
    helm = _helm()
    if helm is None:
        return None
    out = subprocess.run(
        [str(helm), "template", "tide", str(ROOT / "deploy/helm/tide"), "-n", "tide-system",
         "-f", str(ROOT / "deploy/helm/values-small.yaml")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for doc in yaml.safe_load_all(out):
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "tide-scaler":
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("TIDE_")}
            env.pop("TIDE_DB", None)
            env.pop("TIDE_TOKEN_FILE", None)  # the identity comes as a certificate here
            env["TIDE_TLS_CA_FILE"] = ca_file
            return env
    raise SystemExit("helm template rendered no tide-scaler Deployment")


def tide(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    r = subprocess.run(
        [PY, "-m", "tide.services.cli", *args], env={**_clean_env(), **env}, cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return r.returncode, r.stderr.strip()


def cli_checks(workdir: Path) -> dict[str, Any]:
    ca = CertificateAuthority.create(workdir / "pki")
    server = ca.issue("tide-scaler-tls", hosts=SERVICE_NAMES, server=True)
    db = f"sqlite:///{workdir / 'scaler.db'}"
    proc = subprocess.Popen(
        [PY, "-m", "tide.services.testing.scaler", "--coordinator", "memory", "--actuator", "memory",
         "--db", db, "--listen", "127.0.0.1:0", "--tls-cert-file", server.cert_file,
         "--tls-key-file", server.key_file, "--tls-client-ca-file", ca.ca_file,
         "--log-format", "json"],
        env=_clean_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        target = _listening(proc)
        port = target.rpartition(":")[2]
        pod = ca.scaler()
        ident = {
            "TIDE_TLS_CLIENT_CERT_FILE": pod.cert_file,
            "TIDE_TLS_CLIENT_KEY_FILE": pod.key_file,
        }
        out: dict[str, Any] = {}
        env = scaler_pod_env(ca.ca_file)
        if env is not None:
            env["TIDE_SCALER"] = f"127.0.0.1:{port}"  # the pod's own port, here a free one
            out["cli_in_pod_rc"], _ = tide(["jobs"], {**env, **ident})
        else:
            out["cli_in_pod_rc"] = None
        forward = ["jobs", "--scaler", f"127.0.0.1:{port}", "--tls-ca-file", ca.ca_file]
        user = ca.user("oncall", "viewer")
        creds = {
            "TIDE_TLS_CLIENT_CERT_FILE": user.cert_file,
            "TIDE_TLS_CLIENT_KEY_FILE": user.key_file,
        }
        out["cli_port_forward_rc"], _ = tide([*forward, "--tls-server-name", "tide-scaler"], creds)
        rc, err = tide(forward, creds)
        out["cli_port_forward_without_name_rc"] = rc
        out["cli_port_forward_without_name_says_tls"] = int(
            "TLS:" in err and "unreachable" not in err
        )
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def _listening(proc: subprocess.Popen[str]) -> str:
    """The scaler's gRPC address, from its LISTENING line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        up = parse_listening(line)
        if up is not None:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return f"127.0.0.1:{up.grpc_port}"
    raise SystemExit("the scaler did not start")


async def healthy_run(workdir: Path, duration_s: float) -> dict[str, Any]:
    settings = HealthySettings(
        workdir / "up", duration_s=duration_s, resize_deadline_s=max(duration_s, 150.0)
    )
    out = await HealthyRun(settings, lambda line: print(f"  {line}", file=sys.stderr)).run()
    for line in out.warnings:
        print(f"  {line}", file=sys.stderr)
    if not out.ok:
        raise SystemExit(
            f"the healthy run failed: {out.error or out.resizes} (logs in {out.state_dir / 'logs'})"
        )
    return healthy_result(out)


def chart_checks(workdir: Path) -> dict[str, Any]:
    helm, kubectl = _helm(), ROOT / ".venv" / "kubetools" / "kubectl"
    if helm is None or not kubectl.exists() or not Sandboxes.available():
        return {"rendered_pods_started": None, "example_resized": None}
    out = ChartRun(workdir, helm, kubectl).run(timeout_s=240.0)
    return {
        "rendered_pods_started": out.pods_started,
        "rendered_pods": len(out.rendered_pods),
        "example_resized": out.example_resized,
        "chart_error": out.error,
        "chart_elapsed_s": out.elapsed_s,
    }


async def run(workdir: Path, duration_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    exit_s, rc = await launcher_without_ca(workdir)
    result: dict[str, Any] = {
        "launcher_without_ca_exit_s": exit_s,
        "launcher_without_ca_rc": rc,
        **await asyncio.to_thread(cli_checks, workdir),
        **await healthy_run(workdir, duration_s),
    }
    result.update(await asyncio.to_thread(chart_checks, workdir / "chart"))
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick size (the only one yet)")
    p.add_argument("--workdir", default="", help="keep files here (default: a temp dir)")
    p.add_argument(
        "--duration-s",
        type=float,
        default=180.0,
        help="wall time of the healthy `tide up` run, seconds (issue 32 names 3 minutes)",
    )
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-install-"))
    result = asyncio.run(run(workdir, args.duration_s))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
