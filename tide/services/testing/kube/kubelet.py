"""A stand-in kubelet (and scheduler) for one node of the emulated cluster.

- registers its Node with ``nvidia.com/gpu`` allocatable;
- binds pending pods to its node when their GPU requests fit what is free
  there (first come; a pod that does not fit stays Pending, as in a full
  cluster);
- runs each bound pod's container as a real local process: the container's
  ``command`` + ``args``, or the image's entrypoint (``images``) + ``args``,
  with the container's environment, the Downward API's ``fieldRef`` values
  resolved (pod name, namespace, uid, node, pod IP, labels, annotations);
- reports the pod's phase: Running once started, Succeeded or Failed with the
  exit code when the process ends;
- on a graceful deletion (``deletionTimestamp``), SIGTERM to the container,
  SIGKILL to its process group after the grace period, then the final delete.

Processes get their own session, a log file each under ``workdir``, and the
directory of this interpreter first on PATH, so ``python`` in a command is
the test's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tide.services.testing.kube.apiserver import KubeApiServer, now_rfc3339
from tide.services.testing.kube.operators import POD
from tide.services.testing.kube.sandbox import Sandboxes
from tide.services.testing.kube.semantics import ApiError, Obj

logger = logging.getLogger(__name__)

NODE_TYPE_ARGS = ("", "v1", "nodes", "Node")
GPU = "nvidia.com/gpu"


def gpu_request(pod: Obj) -> int:
    """GPUs a pod asks for: the sum over its containers (limits, else requests)."""
    n = 0
    for c in pod.get("spec", {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU, (res.get("requests") or {}).get(GPU, 0))
        n += int(value)
    return n


def _field(pod: Obj, path: str) -> str:
    meta = pod.get("metadata", {})
    for prefix, table in (
        ("metadata.labels", meta.get("labels") or {}),
        ("metadata.annotations", meta.get("annotations") or {}),
    ):
        if path.startswith(prefix + "["):
            key = path[len(prefix) + 1 : -1].strip("'\"")
            return str(table.get(key, ""))
    cur: Any = pod
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def container_env(pod: Obj, container: Obj) -> dict[str, str]:
    """The container's environment as the kubelet gives it (Downward API resolved)."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif (ref := (e.get("valueFrom") or {}).get("fieldRef")) is not None:
            env[e["name"]] = _field(pod, ref["fieldPath"])
    return env


def _probe_port(container: Obj) -> int | None:
    """The readiness probe's port (a number, or a named container port), or None."""
    probe = container.get("readinessProbe") or {}
    for kind in ("grpc", "tcpSocket", "httpGet"):
        port = (probe.get(kind) or {}).get("port")
        if isinstance(port, int):
            return port
        for p in container.get("ports") or []:
            if port is not None and p.get("name") == port:
                return int(p["containerPort"])
    return None


def _with_ready(pod: Obj) -> Obj:
    status = pod.setdefault("status", {})
    status["conditions"] = [{"type": "Ready", "status": "True"}]
    for c in status.get("containerStatuses") or []:
        c["ready"] = True
    return pod


class KubeletStandIn:
    """One node: ``start()``, ``stop()`` (which kills whatever it still runs)."""

    def __init__(
        self,
        api: KubeApiServer,
        node_name: str,
        workdir: Path,
        *,
        gpus: int = 8,
        images: Mapping[str, Sequence[str]] | None = None,
        extra_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        sandbox: Sandboxes | None = None,
    ) -> None:
        """``sandbox``: run each container in its pod's sandbox (volumes at their mount
        paths, cluster DNS, a pod IP of its own: sandbox.py); without it, as a plain
        process with the environment only."""
        self.api = api
        self.node_name = node_name
        self.workdir = workdir
        self.gpus = gpus
        self.images = dict(images or {})
        self.extra_env = dict(extra_env or {})
        self.cwd = cwd
        self.sandbox = sandbox
        self.procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.exit_codes: dict[tuple[str, str], int] = {}
        self._uids: dict[tuple[str, str], str] = {}
        self._terminating: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{node_name}", daemon=True)
        workdir.mkdir(parents=True, exist_ok=True)

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> KubeletStandIn:
        node_t = self.api.rtype("", "v1", "nodes")
        node = {
            "metadata": {
                "name": self.node_name,
                "labels": {"kubernetes.io/hostname": self.node_name, f"{GPU}.present": "true"},
            },
            "spec": {},
            "status": {
                "capacity": {GPU: str(self.gpus), "cpu": "16", "memory": "64Gi"},
                "allocatable": {GPU: str(self.gpus), "cpu": "16", "memory": "64Gi"},
                "conditions": [{"type": "Ready", "status": "True"}],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            },
        }
        with contextlib.suppress(ApiError):
            self.api.create(node_t, node)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def _run(self) -> None:
        seen = 0
        while not self._stop.is_set() and not self.api.closing:
            seen = self.api.wait_changed(seen, 0.5)
            try:
                self.sync()
            except ApiError as exc:
                logger.debug("kubelet %s: %s", self.node_name, exc.message)

    # -- the sync loop ------------------------------------------------------------------

    def sync(self) -> None:
        pods, _ = self.api.list(POD)
        if self.sandbox is not None:
            self.sandbox.refresh_hosts()
        self._schedule([p for p in pods if not p.get("spec", {}).get("nodeName")], pods)
        for pod in pods:
            if pod.get("spec", {}).get("nodeName") != self.node_name:
                continue
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            uid = pod["metadata"]["uid"]
            with self._lock:
                proc = self.procs.get(key) if self._uids.get(key) == uid else None
                exited = key in self.exit_codes and self._uids.get(key) == uid
            if pod["metadata"].get("deletionTimestamp"):
                self.api.tokens.revoke_pod(uid)
                if proc is not None and proc.poll() is None:
                    self._terminate(key, proc, pod)
                elif proc is None or proc.poll() is not None:
                    with contextlib.suppress(ApiError):
                        self.api.delete(POD, key[0], key[1], grace_s=0)
                continue
            if proc is None and not exited and pod.get("status", {}).get("phase") == "Pending":
                self._start(key, pod)

    def _schedule(self, unbound: list[Obj], pods: list[Obj]) -> None:
        node_t = self.api.rtype("", "v1", "nodes")
        try:
            node = self.api.get(node_t, "", self.node_name)
        except ApiError:
            return
        if node.get("spec", {}).get("unschedulable"):
            return
        used = sum(
            gpu_request(p)
            for p in pods
            if p.get("spec", {}).get("nodeName") == self.node_name
            and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        )
        free = int(node["status"]["allocatable"].get(GPU, 0)) - used
        for pod in unbound:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            need = gpu_request(pod)
            if need > free:
                self._unschedulable(pod, need, free)
                continue
            rv = pod["metadata"]["resourceVersion"]

            def bind(cur: Obj) -> Obj:
                cur["spec"]["nodeName"] = self.node_name
                return cur

            try:
                self.api.update(
                    POD, pod["metadata"]["namespace"], pod["metadata"]["name"], bind, want_rv=rv
                )
            except ApiError:
                continue  # bound elsewhere, or gone
            free -= need

    def _unschedulable(self, pod: Obj, need: int, free: int) -> None:
        """What the scheduler reports of a pod that fits nowhere (PodScheduled False)."""
        conds = pod.get("status", {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" for c in conds):
            return
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": f"0/1 nodes are available: {need} {GPU} requested, {free} free.",
        }
        self._set_status(
            (pod["metadata"]["namespace"], pod["metadata"]["name"]), {"conditions": [cond]}
        )

    def _start(self, key: tuple[str, str], pod: Obj) -> None:
        container = (pod["spec"].get("containers") or [{}])[0]
        command = list(container.get("command") or self.images.get(container.get("image", ""), []))
        argv = [*command, *(container.get("args") or [])]
        if not argv:
            self._set_phase(key, "Failed", message="no command and no entrypoint for the image")
            return
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        # The pod IP is known before the process starts, as with a real sandbox.
        ip = self.sandbox.pod_ip(pod) if self.sandbox is not None else "127.0.0.1"
        self._set_status(key, {"podIP": ip, "hostIP": "127.0.0.1"})
        pod = self.api.get(POD, *key)
        own = container_env(pod, container)
        if self.sandbox is not None:
            try:
                argv, own = self.sandbox.prepare(pod, container, own)
            except ApiError as exc:  # a volume's or env's object is missing: ContainerCreating
                logger.debug("kubelet: pod %s/%s waits: %s", *key, exc.message)
                return
        env = {
            **os.environ,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            **self.extra_env,
            **own,
        }
        log = self.workdir / f"{key[0]}_{key[1]}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.cwd) if self.cwd else None,
                start_new_session=True,
            )
        with self._lock:
            self.procs[key] = proc
            self._uids[key] = pod["metadata"]["uid"]
            self.exit_codes.pop(key, None)
        now = now_rfc3339()
        probe_port = _probe_port(container)
        ready = probe_port is None
        self._set_status(
            key,
            {
                "phase": "Running",
                "startTime": now,
                "conditions": [{"type": "Ready", "status": str(ready)}],
                "containerStatuses": [
                    {
                        "name": container.get("name", "worker"),
                        "ready": ready,
                        "restartCount": 0,
                        "image": container.get("image", ""),
                        "state": {"running": {"startedAt": now}},
                    }
                ],
            },
        )
        threading.Thread(
            target=self._wait, args=(key, proc, pod["metadata"]["uid"]), daemon=True
        ).start()
        if probe_port is not None:
            threading.Thread(
                target=self._probe, args=(key, proc, ip, probe_port), daemon=True
            ).start()

    def _probe(
        self, key: tuple[str, str], proc: subprocess.Popen[bytes], ip: str, port: int
    ) -> None:
        """The readiness probe, as a TCP connect to its port (a gRPC or HTTP probe's
        server accepts first): Ready once it answers."""
        while proc.poll() is None and not self._stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1):
                self.api.update(
                    POD,
                    key[0],
                    key[1],
                    lambda cur: _with_ready(cur),
                    subresource="status",
                )
                return
            self._stop.wait(0.5)

    def _wait(self, key: tuple[str, str], proc: subprocess.Popen[bytes], uid: str) -> None:
        code = proc.wait()
        with self._lock:
            if self._uids.get(key) == uid:
                self.exit_codes[key] = code
        try:
            pod = self.api.get(POD, *key)
        except ApiError:
            return
        if pod["metadata"]["uid"] != uid:
            return
        if pod["metadata"].get("deletionTimestamp"):
            with contextlib.suppress(ApiError):
                self.api.delete(POD, key[0], key[1], grace_s=0)
            return
        self._set_phase(key, "Succeeded" if code == 0 else "Failed", exit_code=code)

    def _terminate(self, key: tuple[str, str], proc: subprocess.Popen[bytes], pod: Obj) -> None:
        with self._lock:
            if proc.pid in self._terminating:
                return
            self._terminating.add(proc.pid)
        grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)

        def kill() -> None:
            if proc.poll() is None:
                logger.warning("kubelet: pod %s/%s ignored SIGTERM; killing it", *key)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(grace, kill)
        timer.daemon = True
        timer.start()

    def _set_phase(
        self, key: tuple[str, str], phase: str, *, exit_code: int = 0, message: str = ""
    ) -> None:
        self._set_status(
            key,
            {
                "phase": phase,
                "message": message,
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [
                    {
                        "name": "worker",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": {"exitCode": exit_code}},
                    }
                ],
            },
        )

    def _set_status(self, key: tuple[str, str], status: Obj) -> None:
        with contextlib.suppress(ApiError):
            self.api.update(
                POD,
                key[0],
                key[1],
                lambda cur: {**cur, "status": {**(cur.get("status") or {}), **status}},
                subresource="status",
            )
