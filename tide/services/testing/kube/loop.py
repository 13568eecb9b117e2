"""The whole loop through the Kubernetes actuator, on the emulated cluster.

What `tide demo` does with the local actuator, with a PaddleJob instead: the
API server emulator, paddle-operator's stand-in, a kubelet that runs each pod's
launcher (``python -m tide.trainer.launch``, the trainer image's entrypoint) with
real Paddle workers of tide/trainer/examples/train_mlp.py, the coordinator and the
scaler as processes (``--actuator kubernetes:KUBECONFIG``), and a synthetic GPU
node whose utilization drives a grow and then a shrink.

1. The PaddleJob (opted in, 2 workers, bounds 2..4) is created; the scaler's
   discovery makes it a job and its JOB_STARTED decision forms generation 1.
2. HIGH load: the scaler grows the job. Before that a 409 is armed on the
   PaddleJob's next update and every watch is cut with its history compacted:
   the actuator must re-read and re-check, the reflectors must re-list (410).
3. LOW load: the scaler shrinks the job; the highest pods drain and go.
4. Replicas go to 0 (every launcher gets SIGTERM), then everything stops; the
   outcome has the decisions, the sample audit, the PaddleJob's replicas and
   the coordinator's world size at the end, the Events, and the emulator's
   counts of conflicts and 410s.

Used by tests/e2e/test_kubernetes.py and bench/k8s.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tide import trainer
from tide.base.client import open_channel
from tide.base.errors import FailedPrecondition
from tide.services.local.load import LoadSettings, SyntheticNode
from tide.services.local.samples import SampleAudit, audit
from tide.services.local.supervisor import ChildSpec, Supervisor
from tide.services.testing.kube.apiserver import KubeApiServer
from tide.services.testing.kube.crds import PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import POD, OperatorStandIn, start_operators
from tide.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, scaler_pb2, scaler_pb2_grpc

logger = logging.getLogger(__name__)

ROOT = Path(trainer.__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "tide" / "trainer" / "examples" / "train_mlp.py"
PY = sys.executable
NS, NAME = "default", "mlp"
JOB_ID = f"{NS}/{NAME}"
RPC_TIMEOUT_S = 5.0
_STATES = {v: k.removeprefix("DECISION_STATE_") for k, v in common_pb2.DecisionState.items()}
_REASONS = {v: k.removeprefix("DECISION_REASON_") for k, v in common_pb2.DecisionReason.items()}


@dataclass(frozen=True)
class LoopSettings:
    state_dir: Path
    start_replicas: int = 2
    max_replicas: int = 4
    warm_pct: float = 60.0
    high_pct: float = 95.0
    low_pct: float = 15.0
    sustain_s: float = 10.0
    bucket_s: float = 2.0
    cooldown_s: float = 10.0
    step_delay_s: float = 0.05
    dataset_size: int = 4096
    global_batch: int = 64
    seed: int = 0
    timeout_s: float = 240.0
    # Arm a 409 on the PaddleJob and a 410 on every watch before the grow.
    inject_faults: bool = True


@dataclass(frozen=True)
class DecisionSummary:
    id: int
    from_replicas: int
    to_replicas: int
    reason: str
    state: str
    pause_s: float
    lost_steps: int
    error: str


@dataclass
class LoopOutcome:
    decisions: list[DecisionSummary] = field(default_factory=list)
    audit: SampleAudit | None = None
    paddlejob_replicas: int = -1
    world_size: int = -1
    #: Pods of the coordinator's active members, and the PaddleJob's live pods, at the end.
    member_pods: list[str] = field(default_factory=list)
    job_pods: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    conflicts: int = 0
    injected_conflicts: int = 0
    expired_watches: int = 0
    elapsed_s: float = 0.0
    error: str = ""

    def completed(self, grow: bool) -> list[DecisionSummary]:
        return [
            d
            for d in self.decisions
            if d.state == "COMPLETED"
            and d.reason != "JOB_STARTED"
            and (d.to_replicas > d.from_replicas) == grow
        ]

    @property
    def lost_steps(self) -> int:
        return sum(d.lost_steps for d in self.decisions)


class KubeLoop:
    def __init__(self, settings: LoopSettings) -> None:
        self.s = settings
        self.dir = settings.state_dir
        self.samples_dir = self.dir / "samples"
        self.ckpt_dir = self.dir / "checkpoints"
        self.api = KubeApiServer()
        self.supervisor = Supervisor(self.dir / "logs")
        self.ops: list[OperatorStandIn] = []
        self.kubelet: KubeletStandIn | None = None
        self.node: SyntheticNode | None = None
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    # -- the cluster and the services ------------------------------------------------------

    async def _start(self) -> tuple[str, str]:
        s = self.s
        for d in (self.samples_dir, self.ckpt_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.api.start()
        install_paddlejob_crds(self.api, PADDLE_OPERATOR)
        self.ops = start_operators(self.api)
        self.kubelet = KubeletStandIn(
            self.api,
            "gpu-node-1",
            self.dir / "pods",
            gpus=s.max_replicas,
            images={"tide-trainer": [PY, "-m", "tide.trainer.launch"]},
            cwd=ROOT,
        ).start()
        kubeconfig = self.api.write_kubeconfig(self.dir / "kubeconfig")
        db = f"sqlite:///{(self.dir / 'tide.db').resolve()}"
        coordinator = await self.supervisor.start(
            ChildSpec(
                "coordinator",
                (
                    PY, "-m", "tide.services.coordinator", "--listen", "127.0.0.1:0", "--db", db,
                    "--heartbeat-interval-s", "1", "--checkpoint-lead-s", "1.5",
                    "--heartbeat-timeout-s", "60",
                    # Plaintext on purpose, said here rather than through TIDE_INSECURE in
                    # the caller's environment: `python -m bench.k8s --quick` runs as
                    # documented. The stand-in kubelet issues no launcher certificates.
                    "--insecure",
                ),
            )
        )  # fmt: skip
        scaler = await self.supervisor.start(
            ChildSpec(
                "scaler",
                (
                    PY, "-m", "tide.services.scaler", "--listen", "127.0.0.1:0", "--db", db,
                    "--coordinator", coordinator.target, "--actuator", f"kubernetes:{kubeconfig}",
                    "--evaluate-interval-s", "0.5", "--rollup-flush-interval-s", "5",
                    "--stale-after-s", "5", "--sustain-s", str(s.sustain_s),
                    "--bucket-s", str(s.bucket_s), "--cooldown-s", str(s.cooldown_s),
                    "--scale-down-stabilization-s", "0", "--max-step", str(s.max_replicas),
                    "--phase-timeout-s", "60",
                    # CPU workers on a shared machine rarely scale: see tide/services/local/demo/spec.py.
                    "--min-scale-up-efficiency", "0", "--insecure",
                ),
            )
        )  # fmt: skip
        return scaler.target, coordinator.target

    def _paddlejob(self, coordinator: str) -> dict[str, Any]:
        s = self.s
        train = [
            "python", str(EXAMPLE), "--dataset-size", str(s.dataset_size),
            "--global-batch", str(s.global_batch), "--seed", str(s.seed), "--steps", "10000000",
            "--ckpt-dir", str(self.ckpt_dir.resolve()), "--ckpt-every-steps", "50", "--keep", "3",
            "--log-dir", str(self.samples_dir.resolve()), "--step-delay-s", str(s.step_delay_s),
        ]  # fmt: skip
        field_env = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
        container = {
            "name": "worker",
            "image": "tide-trainer",
            "args": ["--", *train],
            "env": [
                {"name": "TIDE_COORDINATOR", "value": coordinator},
                *(
                    {"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}}
                    for k, v in field_env.items()
                ),
            ],
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        }
        return {
            "metadata": {"name": NAME, "annotations": {"tide.dev/autoscale": "true"}},
            "spec": {
                "worker": {
                    "replicas": s.start_replicas,
                    "requests": s.start_replicas,
                    "limits": s.max_replicas,
                    "template": {"spec": {"containers": [container]}},
                }
            },
        }

    def _attribution(self) -> dict[int, tuple[str, str]]:
        """GPU i of the node → the job's running pod with index i."""
        pods, _ = self.api.list(POD, NS)
        out = {}
        for p in pods:
            name = p["metadata"]["name"]
            head, _, idx = name.rpartition("-worker-")
            if head == NAME and idx.isdigit() and p.get("status", {}).get("phase") == "Running":
                out[int(idx)] = (NS, name)
        return out

    # -- the run ----------------------------------------------------------------------------

    async def run(self) -> LoopOutcome:
        out = LoopOutcome()
        stop = asyncio.Event()
        node_task: asyncio.Task[None] | None = None
        try:
            scaler_t, coord_t = await self._start()
            self.api.create(PADDLE_OPERATOR, self._paddlejob(coord_t), NS)
            self.node = SyntheticNode(
                scaler_t, self._attribution, LoadSettings("gpu-node-1", gpus=self.s.max_replicas)
            )
            self.node.level_pct = self.s.warm_pct
            node_task = asyncio.create_task(self.node.run(stop))
            async with open_channel(scaler_t) as sch, open_channel(coord_t) as cch:
                scaler: Any = scaler_pb2_grpc.ScalerStub(sch)
                coord: Any = coordinator_pb2_grpc.CoordinatorStub(cch)
                await self._drive(scaler, out)
                out.decisions = await self._decisions(scaler)
                st = await coord.GetJobStatus(
                    coordinator_pb2.GetJobStatusRequest(job_id=JOB_ID), timeout=RPC_TIMEOUT_S
                )
                out.world_size = st.world_size
                out.member_pods = sorted(
                    m.pod_name for m in st.members if m.state == coordinator_pb2.MEMBER_STATE_ACTIVE
                )
            out.job_pods = sorted(
                p["metadata"]["name"]
                for p in self.api.list(POD, NS)[0]
                if not p["metadata"].get("deletionTimestamp")
            )
            job = self.api.get(PADDLE_OPERATOR, NS, NAME)
            out.paddlejob_replicas = job["spec"]["worker"]["replicas"]
        except Exception as exc:
            out.error = str(exc) or type(exc).__name__
            logger.exception("kube loop failed")
        finally:
            stop.set()
            if node_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(node_task, 5)
            out.events = self._events()
            out.conflicts = self.api.stats.conflicts
            out.injected_conflicts = self.api.stats.injected_conflicts
            out.expired_watches = self.api.stats.gone
            await self._stop()
            out.elapsed_s = self.elapsed()
        if self.samples_dir.is_dir() and any(self.samples_dir.iterdir()):
            out.audit = audit(
                self.samples_dir,
                dataset_size=self.s.dataset_size,
                global_batch=self.s.global_batch,
                seed=self.s.seed,
            )
        return out

    async def _drive(self, scaler: Any, out: LoopOutcome) -> None:
        s = self.s
        assert self.node is not None
        phase = "starting"
        while phase != "done":
            if self.elapsed() > s.timeout_s:
                raise FailedPrecondition(f"timed out after {s.timeout_s:g} s in phase {phase}")
            for child in self.supervisor.children:
                if child.proc.returncode is not None:
                    raise FailedPrecondition(f"{child.name} exited; see {child.log_path}")
            decisions = await self._decisions(scaler)
            out.decisions = decisions
            done = [d for d in decisions if d.state == "COMPLETED"]
            if any(
                d.state in ("ABORTED", "FAILED") and d.reason == "JOB_STARTED" for d in decisions
            ):
                raise FailedPrecondition(f"the job did not start: {decisions}")
            if phase == "starting" and any(d.reason == "JOB_STARTED" for d in done):
                if s.inject_faults:
                    # The next write to the PaddleJob meets a 409; every watch is cut and
                    # the history it would resume from is gone (410 on the re-watch).
                    self.api.conflict_next("paddlejobs")
                    self.api.compact()
                    self.api.drop_watches()
                phase, self.node.level_pct = "high", s.high_pct
            elif phase == "high" and out.completed(grow=True):
                phase, self.node.level_pct = "low", s.low_pct
            elif phase == "low" and out.completed(grow=False):
                phase = "done"
            logger.info(
                "kube loop: %.0f s, phase %s, decisions %s", self.elapsed(), phase, decisions
            )
            await asyncio.sleep(0.5)

    async def _decisions(self, scaler: Any) -> list[DecisionSummary]:
        try:
            resp = await scaler.ListDecisions(
                scaler_pb2.ListDecisionsRequest(job_id=JOB_ID, page_size=100), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return []  # discovery has not made the job yet
            raise
        return sorted(
            (
                DecisionSummary(
                    d.id,
                    d.from_replicas,
                    d.to_replicas,
                    _REASONS.get(d.reason, str(d.reason)),
                    _STATES.get(d.state, str(d.state)),
                    d.pause_s,
                    d.lost_steps,
                    d.error,
                )
                for d in resp.decisions
            ),
            key=lambda d: d.id,
        )

    def _events(self) -> list[tuple[str, str, str]]:
        items, _ = self.api.list(
            self.api.rtype("", "v1", "events"), NS, fields=f"involvedObject.name={NAME}"
        )
        items.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [(e["type"], e["reason"], e["message"]) for e in items]

    def _wait_no_pods(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while self.api.list(POD, NS)[0] and time.monotonic() < deadline:
            seen = self.api.wait_changed(seen, max(0.0, deadline - time.monotonic()))

    async def _stop(self) -> None:
        for child in [c for c in self.supervisor.children if c.name == "scaler"]:
            await self.supervisor.stop(child)
        # Every launcher gets SIGTERM from its pod's deletion and stops its worker cleanly.
        with contextlib.suppress(Exception):

            def none(job: dict[str, Any]) -> dict[str, Any]:
                job["spec"]["worker"]["replicas"] = 0
                return job

            self.api.update(PADDLE_OPERATOR, NS, NAME, none)
            await asyncio.to_thread(self._wait_no_pods, 30.0)
        await self.supervisor.stop_all()
        for op in self.ops:
            op.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        self.api.close()
