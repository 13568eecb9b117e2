"""Stand-ins for the two PaddleJob operators: pods by index from the worker replicas.

What both real operators do with the workers of a PaddleJob (and all that Tide
depends on): pod ``i`` of job ``NAME`` is ``NAME-worker-i`` for i in
0..replicas-1, created from the worker template with the operator's labels
and an owner reference to the job; pods whose index is >= replicas are
deleted (so a shrink removes the highest indexes), missing ones are created.

- paddle-operator (``batch.paddlepaddle.org/v1``, PaddleFlow): replicas in
  ``spec.worker.replicas``; labels ``paddle-res-name`` (the pod name) and
  ``paddle-res-type: worker``; ``PADDLE_TRAINER_ID`` (the index) and
  ``POD_IP`` (Downward API) in every container's environment.
- Kubeflow training-operator (``kubeflow.org/v1``): replicas in
  ``spec.paddleReplicaSpecs.Worker.replicas``; labels
  ``training.kubeflow.org/job-name``, ``.../replica-type: worker`` and
  ``.../replica-index``.

Each stand-in is a thread in the test's process, reading and writing the
emulator's objects directly, woken by any change (no polling).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tide.services.testing.kube.apiserver import KubeApiServer, ResourceType
from tide.services.testing.kube.crds import KUBEFLOW, PADDLE_OPERATOR
from tide.services.testing.kube.semantics import ApiError, Obj

logger = logging.getLogger(__name__)

POD = ResourceType("", "v1", "pods", "Pod", status_subresource=True)


@dataclass(frozen=True)
class OperatorKind:
    rtype: ResourceType
    worker_spec: Callable[[Obj], Obj]
    labels: Callable[[Obj, int], dict[str, str]]
    env: Callable[[Obj, int], list[Obj]]


def _paddle_worker(job: Obj) -> Obj:
    return dict(job.get("spec", {}).get("worker") or {})


def _kubeflow_worker(job: Obj) -> Obj:
    return dict((job.get("spec", {}).get("paddleReplicaSpecs") or {}).get("Worker") or {})


def pod_name(job_name: str, index: int) -> str:
    """Both operators name worker ``i`` of job ``N`` as ``N-worker-i``."""
    return f"{job_name}-worker-{index}"


PADDLE = OperatorKind(
    PADDLE_OPERATOR,
    _paddle_worker,
    lambda job, i: {
        "paddle-res-name": pod_name(job["metadata"]["name"], i),
        "paddle-res-type": "worker",
    },
    lambda job, i: [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PADDLE_TRAINER_ID", "value": str(i)},
    ],
)
KUBEFLOW_OPERATOR = OperatorKind(
    KUBEFLOW,
    _kubeflow_worker,
    lambda job, i: {
        "training.kubeflow.org/job-name": job["metadata"]["name"],
        "training.kubeflow.org/operator-name": "paddlejob-controller",
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": str(i),
    },
    lambda job, i: [],
)


class OperatorStandIn:
    """Reconciles every PaddleJob of one kind, in a thread, until ``stop()``."""

    def __init__(self, api: KubeApiServer, kind: OperatorKind) -> None:
        self.api = api
        self.kind = kind
        self.reconciles = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"operator-{kind.rtype.group}", daemon=True
        )

    def start(self) -> OperatorStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        seen = 0
        while not self._stop.is_set() and not self.api.closing:
            seen = self.api.wait_changed(seen, 0.5)
            try:
                self.reconcile_all()
            except ApiError as exc:
                # A conflict with another writer: the next change brings us back.
                logger.debug("operator %s: %s", self.kind.rtype.group, exc.message)

    def reconcile_all(self) -> None:
        try:
            jobs, _ = self.api.list(self.kind.rtype)
        except ApiError:
            return  # the CRD is not installed (yet)
        pods, _ = self.api.list(POD)
        by_owner: dict[str, dict[int, Obj]] = {}
        for p in pods:
            for ref in p["metadata"].get("ownerReferences") or []:
                idx = _index(p["metadata"]["name"])
                if idx is not None and ref.get("apiVersion") == self.kind.rtype.group_version:
                    by_owner.setdefault(ref["uid"], {})[idx] = p
        for job in jobs:
            self._reconcile(job, by_owner.pop(job["metadata"]["uid"], {}))
        # What is left belongs to deleted jobs: the garbage collector's work.
        for orphans in by_owner.values():
            for p in orphans.values():
                if not p["metadata"].get("deletionTimestamp"):
                    self.api.delete(POD, p["metadata"]["namespace"], p["metadata"]["name"])
        self.reconciles += 1

    def _reconcile(self, job: Obj, pods: dict[int, Obj]) -> None:
        if job["metadata"].get("deletionTimestamp"):
            return
        worker = self.kind.worker_spec(job)
        want = int(worker.get("replicas") or 0)
        ns = job["metadata"]["namespace"]
        for i in sorted(pods, reverse=True):
            if i >= want and not pods[i]["metadata"].get("deletionTimestamp"):
                self.api.delete(POD, ns, pods[i]["metadata"]["name"])
        for i in range(want):
            if i not in pods:
                try:
                    self.api.create(POD, self._pod(job, worker, i), ns)
                except ApiError as exc:
                    if exc.code != 409:  # a pod of that name is still terminating
                        raise
        running = sum(1 for p in pods.values() if p.get("status", {}).get("phase") == "Running")
        status = {"worker": {"running": running}, "phase": "Running" if running else "Pending"}
        if job.get("status") != {**(job.get("status") or {}), **status}:
            self.api.update(
                self.kind.rtype,
                ns,
                job["metadata"]["name"],
                lambda cur: {**cur, "status": {**(cur.get("status") or {}), **status}},
                subresource="status",
            )

    def _pod(self, job: Obj, worker: Obj, index: int) -> Obj:
        template: Obj = copy.deepcopy(worker.get("template") or {})
        meta = template.get("metadata") or {}
        spec = template.get("spec") or {}
        name = pod_name(job["metadata"]["name"], index)
        extra_env = self.kind.env(job, index)
        for c in spec.get("containers") or []:
            c["env"] = [*extra_env, *(c.get("env") or [])]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {**(meta.get("labels") or {}), **self.kind.labels(job, index)},
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": self.kind.rtype.group_version,
                        "kind": self.kind.rtype.kind,
                        "name": job["metadata"]["name"],
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }


def _index(pod: str) -> int | None:
    head, _, tail = pod.rpartition("-worker-")
    return int(tail) if head and tail.isdigit() else None


def start_operators(api: KubeApiServer) -> list[OperatorStandIn]:
    """Both operators, started."""
    return [OperatorStandIn(api, k).start() for k in (PADDLE, KUBEFLOW_OPERATOR)]


def job_pods(api: KubeApiServer, namespace: str, job_uid: str) -> list[Any]:
    """The pods a job owns, by index."""
    pods, _ = api.list(POD, namespace)
    owned = [
        p
        for p in pods
        if any(r.get("uid") == job_uid for r in p["metadata"].get("ownerReferences") or [])
    ]
    return sorted(owned, key=lambda p: _index(p["metadata"]["name"]) or 0)
