"""The chart installed on the emulated cluster with security on, as docs/install.md says,
its pods run by the stand-in kubelet in their sandboxes (sandbox.py), then the shipped
example PaddleJob trained and resized by hand from inside the scaler's pod.

- the API server over HTTPS with bearer tokens required and TokenReview served
  (auth.py); the chart's pods find it through their mounted ServiceAccount;
- cert-manager's stand-in (controllers.py) issues the Certificates the chart asks for
  from the ``tide-ca`` issuer's CA; every Tide link is mTLS or TLS + a bound token;
- ``kubectl create namespace``, ``kubectl apply`` of ``helm template`` (values-small.yaml,
  an admin token Secret), the Deployment and DaemonSet controllers, the kubelet;
- ``deploy/examples/paddlejob-paddle-operator.yaml`` applied as shipped (with the
  PersistentVolumeClaim it names), its image the trainer's entrypoint with
  tide/trainer/examples/train_mlp.py as /app/train.py;
- ``tide scale`` run in the scaler pod (``kubectl exec`` as ``nsenter`` into its mount
  namespace, with its environment), up one and back once the job trains; each decision
  followed to its final state by the Event the scaler posts on the PaddleJob, then
  ``tide history`` in the pod, with the pod's own credentials, must show both COMPLETED.

Used by tests/deploy/test_chart_e2e.py and bench/install.py.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from tide.services.common.pki import CertificateAuthority
from tide.services.testing.kube.apiserver import KubeApiServer
from tide.services.testing.kube.controllers import Controllers
from tide.services.testing.kube.crds import PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import POD, OperatorStandIn, start_operators
from tide.services.testing.kube.sandbox import Image, Sandboxes

ROOT = Path(__file__).resolve().parents[4]
CHART = ROOT / "deploy" / "helm" / "tide"
EXAMPLE = ROOT / "deploy" / "examples" / "paddlejob-paddle-operator.yaml"
TRAIN = ROOT / "tide" / "trainer" / "examples" / "train_mlp.py"
NS = "tide-system"
REPO = "registry.example.com/tide"
JOB = "ml-research/resnet"
#: The scaler's Event reasons for a decision's final states (tide/services/scaler/kube/events.py).
FINAL_EVENTS = {
    "SuccessfulRescale": "COMPLETED",
    "AbortedRescale": "ABORTED",
    "FailedRescale": "FAILED",
}


def _last_checkpoint(d: Path) -> int:
    """The highest step of a checkpoint in ``d``, or 0: tide/trainer/checkpoint.py renames
    ``step-N.tmp-<nonce>`` to ``step-N`` once it is complete."""
    names = (m.group(1) for c in d.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", c.name)))
    return max(map(int, names), default=0)


@dataclass
class ChartOutcome:
    rendered_pods: list[str] = field(default_factory=list)
    pods_started: int = 0
    scale_rcs: list[int] = field(default_factory=list)
    example_resized: int = 0
    error: str = ""
    elapsed_s: float = 0.0
    #: From the rendered chart applied to its pods all Ready; then from the example
    #: applied to its second resize COMPLETED (0 where not reached).
    ready_s: float = 0.0
    resized_s: float = 0.0


class ChartRun:
    def __init__(self, workdir: Path, helm: Path, kubectl: Path) -> None:
        self.dir = workdir
        self.helm, self.kubectl = helm, kubectl
        workdir.mkdir(parents=True, exist_ok=True)
        cluster_ca = CertificateAuthority.create(workdir / "cluster-ca", name="kubernetes")
        serving = cluster_ca.issue(
            "apiserver", hosts=("127.0.0.1", "kubernetes.default.svc"), server=True
        )
        self.api = KubeApiServer(
            tls=(serving.cert_file, serving.key_file, cluster_ca.ca_file), require_auth=True
        )
        self.issuer = CertificateAuthority.create(workdir / "tide-ca", name="tide-ca")
        self.kubeconfig = workdir / "kubeconfig"
        self.admin_token = os.urandom(16).hex()
        self.ops: list[OperatorStandIn] = []
        self.controllers = Controllers(self.api, self.issuer)
        # The user's /app/train.py of the image: the example MLP, trained until stopped
        # (its default 60 steps end before a resize could), a little slower than flat out.
        train = workdir / "image" / "train.py"
        train.parent.mkdir(parents=True, exist_ok=True)
        train.write_text(
            "import runpy, sys\n"
            f"sys.argv = [{str(TRAIN)!r}, '--steps', '10000000', '--step-delay-s', '0.05',"
            " '--ckpt-every-steps', '50', *sys.argv[1:]]\n"
            f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
        )
        trainer = Image((sys.executable, "-m", "tide.trainer.launch"), {"/app/train.py": train})
        self.sandbox = Sandboxes(
            self.api, workdir / "node", "gpu-node-1", {"registry.example.com/ml/resnet:1": trainer}
        )
        self.kubelet = KubeletStandIn(
            self.api, "gpu-node-1", workdir / "logs", cwd=ROOT, sandbox=self.sandbox
        )

    # -- tools ---------------------------------------------------------------------------------

    def kubectl_run(self, *args: str, stdin: str | None = None) -> str:
        done = subprocess.run(
            [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def render(self) -> str:
        return subprocess.run(
            [str(self.helm), "template", "tide", str(CHART), "-n", NS,
             "-f", str(CHART.parent / "values-small.yaml"), "--set", f"image.repository={REPO}",
             "--set", "adminToken.existingSecret=tide-admin-token",
             # The stand-in node has no NVIDIA driver: the agent's synthetic GPUs.
             "--set", "agent.settings.source=synthetic"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip

    def exec_in(
        self, pod: dict[str, Any], argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl exec``: argv in the pod's mount namespace with its container's env."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        proc = self.kubelet.procs[key]
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        penv = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
        return subprocess.run(
            ["nsenter", "-t", str(proc.pid), "-m", "--root", "--wd=/", *argv],
            env={**penv, **(env or {})}, capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip

    # -- steps ---------------------------------------------------------------------------------

    def _wait(self, what: str, cond: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            seen = self.api.wait_changed(seen, 1.0)
        raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")

    def _chart_pods(self) -> list[dict[str, Any]]:
        return [
            p
            for p in self.api.list(POD, NS)[0]
            if not p["metadata"].get("deletionTimestamp")
            and any(r.get("kind") in ("Deployment", "DaemonSet", "StatefulSet")
                    for r in p["metadata"].get("ownerReferences") or [])
        ]  # fmt: skip

    @staticmethod
    def _ready(p: dict[str, Any]) -> bool:
        return p.get("status", {}).get("phase") == "Running" and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in p["status"].get("conditions") or []
        )

    def _decision_state(self, decision: int) -> str | None:
        """A decision's final state, from the Event the scaler posts on the PaddleJob when
        it gets there (what ``kubectl describe`` shows), or None. Looked at on every
        change of the API server: a `tide explain` started for each look was a cold
        Python start each, back to back, which on a loaded machine took a core from
        the training and the services being measured."""
        for ev in self.api.list(self.api.rtype("", "v1", "events"), JOB.split("/")[0])[0]:
            state = FINAL_EVENTS.get(ev.get("reason", ""))
            if state and f"decision {decision}, " in ev.get("message", ""):
                return state
        return None

    def install(self, out: ChartOutcome, timeout_s: float) -> None:
        self.api.start()
        self.api.write_kubeconfig(self.kubeconfig)
        self.controllers.start()
        install_paddlejob_crds(self.api, PADDLE_OPERATOR)
        self.ops = start_operators(self.api)
        self.kubelet.start()
        # `kubectl create namespace|secret` send protobuf, which the emulator does not
        # read: the same objects through `kubectl apply`.
        for ns in (NS, "ml-research"):
            self.kubectl_run("apply", "-f", "-", stdin=json.dumps(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))  # fmt: skip
        issuer = {"apiVersion": "cert-manager.io/v1", "kind": "Issuer",
                  "metadata": {"name": "tide-ca"}, "spec": {"ca": {"secretName": "tide-ca"}}}  # fmt: skip
        self.kubectl_run("apply", "-n", NS, "-f", "-", stdin=json.dumps(issuer))
        admin = {"apiVersion": "v1", "kind": "Secret",
                 "metadata": {"name": "tide-admin-token", "namespace": NS},
                 "data": {"token": base64.b64encode(self.admin_token.encode()).decode()}}  # fmt: skip
        self.kubectl_run("apply", "-f", "-", stdin=json.dumps(admin))
        rendered = self.render()
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        out.rendered_pods = [
            f"{d['kind']}/{d['metadata']['name']}"
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
        ]
        t0 = time.monotonic()
        self.kubectl_run("apply", "-f", "-", stdin=rendered)

        def started() -> list[dict[str, Any]] | None:
            pods = self._chart_pods()
            owners = {r["name"] for p in pods for r in p["metadata"]["ownerReferences"]}
            want = {w.split("/")[1] for w in out.rendered_pods}
            ok = want <= owners and all(self._ready(p) for p in pods)
            return pods if ok else None

        out.pods_started = len(self._wait("the chart's pods Ready", started, timeout_s))
        out.ready_s = round(time.monotonic() - t0, 1)

    def example(self, out: ChartOutcome, timeout_s: float) -> None:
        pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": "resnet-ckpt", "namespace": "ml-research"},
               "spec": {"accessModes": ["ReadWriteMany"],
                        "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
        t0 = time.monotonic()
        self.kubectl_run("apply", "-f", "-", stdin=json.dumps(pvc))
        self.kubectl_run("apply", "-f", str(EXAMPLE))
        (scaler,) = [
            p for p in self._chart_pods() if p["metadata"]["name"].startswith("tide-scaler-")
        ]
        tide = [sys.executable, "-m", "tide.services.cli"]
        deadline = time.monotonic() + timeout_s

        def left_s() -> float:
            return max(1.0, deadline - time.monotonic())

        # The job's start (decision 1) first: a resize asked while it runs is refused.
        self._wait("decision 1", partial(self._decision_state, 1), left_s())
        ckpt = self.sandbox.root / "pvc" / "ml-research" / "resnet-ckpt"
        decisions: dict[int, int] = {}  # decision → replicas
        for replicas in (3, 2):
            # Each resize once the job trains at speed in its generation: 100 steps
            # past the checkpoints on the claim now (two periodic checkpoints). The
            # coordinator sets the barrier step from the rate it last measured: asked
            # in a generation's first seconds (no rate yet, or one that spans the
            # restart's slow first steps), the barrier was a few steps ahead, the
            # workers were past it when the CHECKPOINT reached them, and the decision
            # was ABORTED (a late CHECKPOINT aborts, safely).
            at = _last_checkpoint(ckpt) + 100

            def trains(at: int = at) -> bool:
                return _last_checkpoint(ckpt) >= at

            self._wait(f"the example's checkpoint of step {at}", trains, left_s())
            while True:
                argv = [
                    *tide,
                    "scale",
                    JOB,
                    "--replicas",
                    str(replicas),
                    "--reason",
                    "chart e2e",
                    "--token",
                    self.admin_token,
                ]
                # The pod's own token names the scaler, which may not resize: an admin
                # call carries the admin token alone (not `--wait`: its WatchDecisions
                # stream then goes without credentials and is refused).
                done = self.exec_in(scaler, argv, {"TIDE_TOKEN_FILE": ""})  # fmt: skip
                if done.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(1.0)  # the job not known to the scaler yet
            out.scale_rcs.append(done.returncode)
            if done.returncode != 0:
                raise RuntimeError(f"tide scale {replicas}: {done.stdout} {done.stderr}")
            decision = int(done.stdout.split(":")[0].split()[-1])
            decisions[decision] = replicas
            follow = partial(self._decision_state, decision)
            state = self._wait(f"decision {decision}", follow, left_s())
            if state != "COMPLETED":
                raise RuntimeError(f"decision {decision} to {replicas} replicas: {state}")
        # Then the history as `tide history` in the pod shows it with the pod's own
        # credentials (one CLI start for both decisions): what the Events said.
        shown = self.exec_in(scaler, [*tide, "history", JOB, "-o", "json"])
        states = {
            d["id"]: (d["to_replicas"], d["state"])
            for d in json.loads(shown.stdout or "{}").get("decisions", [])
        }
        for decision, replicas in decisions.items():
            if states.get(decision) != (replicas, "COMPLETED"):
                raise RuntimeError(
                    f"tide history: decision {decision} is {states.get(decision)}, not"
                    f" COMPLETED to {replicas}: {shown.stdout} {shown.stderr}"
                )
        out.example_resized = 1
        out.resized_s = round(time.monotonic() - t0, 1)

    def stop(self) -> None:
        self.kubelet.stop()
        for op in self.ops:
            op.stop()
        self.controllers.stop()
        self.api.close()

    def run(
        self,
        timeout_s: float = 120.0,
        *,
        example: bool = True,
        example_timeout_s: float | None = None,
    ) -> ChartOutcome:
        """``timeout_s`` for the pods to be Ready, and for the example too unless
        ``example_timeout_s`` says otherwise."""
        out = ChartOutcome()
        t0 = time.monotonic()
        try:
            self.install(out, timeout_s)
            if example:
                self.example(out, timeout_s if example_timeout_s is None else example_timeout_s)
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.stop()
            out.elapsed_s = round(time.monotonic() - t0, 1)
        return out
