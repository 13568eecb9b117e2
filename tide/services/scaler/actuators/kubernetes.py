"""The Kubernetes actuator: a job's pods are the workers of its PaddleJob.

Same contract as every actuator (tide.services.scaler.actuators.base.Actuator), for
both PaddleJob kinds (tide.services.scaler.kube.paddlejob):

- ``set_replicas`` is a merge patch of the worker replicas carrying the
  resourceVersion it read. A 409 means someone wrote in between: the job is
  read again and the change re-checked (still opted in, still within the
  PaddleJob's bounds, not already done) before the next try; it never
  overwrites blindly. The patch also writes the scaler's owner epoch for the
  job (``OWNER_EPOCH``), and a PaddleJob that carries a newer one refuses the
  change (StaleEpoch): a paused old leader cannot write over a new leader's
  work even when its own view of the lease is stale. Then it waits, by watch, until the operator has made the
  pods match: all of 0..n-1 present after a grow, none of n.. left after a
  shrink (both operators remove the highest indexes, which are the members
  the coordinator drained). A wait that runs out is logged, not failed: the
  coordinator's deadline judges the newcomers.
- ``remove_pods`` (tide.services.scaler.actuators.base.PodRemover: a preemption's
  named pods). Both operators delete the pods whose index is >= the replicas
  and recreate any missing pod below it (paddle-operator's Reconcile,
  training-operator's ReconcilePods), so lowering the count alone would stop
  the highest index, a member of the generation just formed. Instead the
  replicas drop only to just above the highest pod that stays, and each named
  pod below that is deleted (with its uid as the precondition, so a repeat never
  deletes the operator's replacement): the operator recreates it, a newcomer
  that waits as a spare until a grow admits it (docs/preemption.md). Only the
  named pods go, never the highest by count: the PaddleJob cannot tell a member
  from a spare of an earlier preemption. The count
  chosen is written on the PaddleJob with the patch (``REMOVAL``), so that a
  resumed decision, whose named pods are gone, keeps it instead of taking the
  spare for a member and a member's index for the spare.
- ``free_gpus`` comes from the watch-backed cache of nodes and pods
  (tide.services.scaler.kube.capacity).

The client is synchronous; its calls run in worker threads. The waits are the
pod cache's watch (list, watch with a timeout, re-list on 410) waking the event
loop, never a poll.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tide.base.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TideError,
    Unavailable,
)
from tide.services.scaler.actuators.base import check_still_leading, owner_epoch
from tide.services.scaler.errors import StaleEpoch
from tide.services.scaler.kube.capacity import CapacityCache
from tide.services.scaler.kube.client import IN_CLUSTER, api_client, raw
from tide.services.scaler.kube.paddlejob import KINDS, JobView, Kind, owned_by, pod_index, view

logger = logging.getLogger(__name__)

#: ``DECISION_ID:REPLICAS`` of the last remove_pods, on the PaddleJob. Outside the
#: ``tide.dev/`` prefix, which holds the policy overrides.
REMOVAL = "scaler.tide.dev/pods-removed"
#: The owner epoch of the scaler that last changed the replicas. A change under an
#: older epoch is refused: a paused old leader whose own clock still says it leads
#: cannot write over a newer leader's work. It only ever rises.
OWNER_EPOCH = "scaler.tide.dev/owner-epoch"


def _resource(job: JobView) -> str:
    return f"{job.kind.plural}.{job.kind.group}"


def _stored_epoch(job: JobView) -> int:
    value = job.annotations.get(OWNER_EPOCH, "")
    return int(value) if value.isdigit() else 0


@dataclass(frozen=True)
class KubernetesActuatorSettings:
    """How the actuator reaches the cluster and how long it waits."""

    # "in-cluster" (the pod's ServiceAccount) or the path of a kubeconfig.
    source: str = IN_CLUSTER
    # Namespaces whose PaddleJobs may be changed; empty: all.
    namespaces: tuple[str, ...] = ()
    # Re-reads after a 409 before a resize gives up (each one re-checks the change).
    conflict_retries: int = 5
    # How long a resize waits for the operator to make the pods match, seconds.
    pod_wait_s: float = 120.0
    # Server-side timeout of each watch, seconds (then it is renewed).
    watch_timeout_s: int = 60
    # Bound of each read and patch of a PaddleJob, seconds: a partitioned API server
    # answers nothing, and the call must end (Unavailable) rather than hang.
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError(
                "actuator kubernetes: expected kubernetes:in-cluster or kubernetes:KUBECONFIG"
            )
        if self.conflict_retries < 0:
            raise ConfigError(f"conflict_retries: must be >= 0, got {self.conflict_retries}")
        if not self.pod_wait_s > 0:
            raise ConfigError(f"pod_wait_s: must be > 0, got {self.pod_wait_s}")
        if self.watch_timeout_s < 1:
            raise ConfigError(f"watch_timeout_s: must be >= 1, got {self.watch_timeout_s}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")


def _split(job_id: str) -> tuple[str, str]:
    ns, sep, name = job_id.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise InvalidArgument(f"job_id must be 'namespace/name', got {job_id!r}")
    return ns, name


def _error(job_id: str, exc: ApiException) -> TideError:
    what = f"job {job_id}: Kubernetes API: {exc.status} {exc.reason}"
    if exc.status == 404:
        return NotFound(what)
    if exc.status in (401, 403):
        return PermissionDenied(what)
    if exc.status in (400, 422):
        return InvalidArgument(what)
    return Unavailable(what)


def _unreachable(job_id: str, exc: HTTPError) -> Unavailable:
    """A transport failure (timeout, refused, reset): the API server is out of reach."""
    return Unavailable(f"job {job_id}: Kubernetes API unreachable: {type(exc).__name__}: {exc}")


def _considered(pod: dict[str, Any]) -> bool:
    """Bound to a node, or marked unschedulable by the scheduler."""
    if pod.get("spec", {}).get("nodeName"):
        return True
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conds)


class KubernetesActuator:
    """Implements tide.services.scaler.actuators.Actuator on PaddleJobs."""

    def __init__(
        self, settings: KubernetesActuatorSettings, api: client.ApiClient | None = None
    ) -> None:
        self.settings = settings
        self.api = api or api_client(settings.source)
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.capacity = CapacityCache(
            self.api, on_change=self._changed, watch_timeout_s=settings.watch_timeout_s
        )
        #: The kind of each job (told by discovery, else found on first read).
        self.kinds: dict[str, Kind] = {}
        #: 409s answered to a resize patch and retried after a re-read.
        self.conflicts_retried = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._waiters_lock = threading.Lock()
        self._started = False

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.capacity.start()

    def stop(self) -> None:
        if self._started:
            self.capacity.stop()

    def _changed(self) -> None:
        """From a reflector's thread: wake every waiting coroutine."""
        with self._waiters_lock:
            waiters = list(self._waiters)
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    async def _wait_until(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        entry = (loop, ev)
        with self._waiters_lock:
            self._waiters.add(entry)
        try:
            deadline = loop.time() + timeout_s
            while not cond():
                left = deadline - loop.time()
                if left <= 0:
                    return False
                ev.clear()
                if cond():
                    return True
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except TimeoutError:
                    return cond()
            return True
        finally:
            with self._waiters_lock:
                self._waiters.discard(entry)

    # -- reading ------------------------------------------------------------------------

    def know(self, job_id: str, kind: Kind) -> None:
        """Discovery tells which kind a job is (saves a lookup per kind)."""
        self.kinds[job_id] = kind

    def _read(self, job_id: str) -> JobView:
        ns, name = _split(job_id)
        if self.settings.namespaces and ns not in self.settings.namespaces:
            raise PermissionDenied(f"job {job_id}: namespace {ns} is not one this scaler manages")
        known = self.kinds.get(job_id)
        last: ApiException | None = None
        for kind in (known,) if known else KINDS:
            try:
                obj = raw(
                    self.custom.get_namespaced_custom_object(
                        kind.group,
                        kind.version,
                        ns,
                        kind.plural,
                        name,
                        _preload_content=False,
                        _request_timeout=self.settings.request_timeout_s,
                    )
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise _error(job_id, exc) from None
                last = exc
                continue
            except HTTPError as exc:
                raise _unreachable(job_id, exc) from None
            self.kinds[job_id] = kind
            return view(kind, obj)
        raise NotFound(f"job {job_id}: no PaddleJob {name} in namespace {ns}") from last

    # -- the Actuator protocol ------------------------------------------------------------

    def adopt(self, job_id: str, *, replicas: int, gpus_per_replica: int) -> None:
        # The PaddleJob is the record of the replicas and the pods' GPUs: nothing to note.
        return None

    async def get_replicas(self, job_id: str) -> int | None:
        try:
            job = await asyncio.to_thread(self._read, job_id)
        except NotFound:
            return None
        return job.replicas

    async def free_gpus(self) -> int | None:
        return self.capacity.free_gpus()

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        if replicas < 0:
            raise InvalidArgument(f"job {job_id}: replicas must be >= 0, got {replicas}")
        self.start()
        job = await asyncio.to_thread(self._patch_replicas, job_id, replicas, decision_id)
        settled = await self._wait_until(
            lambda: self._pods_match(job, replicas), self.settings.pod_wait_s
        )
        if not settled:
            logger.warning(
                "job %s: decision %d: the pods did not match %d replica(s) within %.0f s: %s",
                job_id,
                decision_id,
                replicas,
                self.settings.pod_wait_s,
                self._pods_summary(job),
                extra={"job_id": job_id, "decision_id": decision_id},
            )

    async def remove_pods(
        self, job_id: str, pods: Sequence[str], *, replicas: int, decision_id: int
    ) -> None:
        if replicas < 0:
            raise InvalidArgument(f"job {job_id}: replicas must be >= 0, got {replicas}")
        named = set(pods)
        if not named:
            await self.set_replicas(job_id, replicas, decision_id=decision_id)
            return
        self.start()
        if not await self._wait_until(self.capacity.pods.synced.is_set, self.settings.pod_wait_s):
            raise Unavailable(f"job {job_id}: the pod cache did not sync; cannot name pods")
        job = await asyncio.to_thread(self._read, job_id)
        doomed = {
            i: (p["metadata"]["name"], p["metadata"].get("uid", ""))
            for i, p in self._pods(job).items()
            if p["metadata"]["name"] in named or p["metadata"].get("uid") in named
        }
        decided, _, chosen = job.annotations.get(REMOVAL, "").partition(":")
        if decided == str(decision_id) and chosen.isdigit():
            count = int(chosen)  # a repeat: the named pods may be spares by now
        else:
            # A named pod gone already (its node went first) leaves its index too.
            gone = {pod_index(n) for n in named if n.startswith(f"{job.name}-worker-")}
            indexes = doomed.keys() | {i for i in gone if i is not None}
            if not indexes:
                # None of them is the job's: the count, as the operator would do it.
                await self.set_replicas(job_id, replicas, decision_id=decision_id)
                return
            # Only the named pods go. The count cannot say which pods are members (a
            # spare from an earlier preemption is not), so it falls only across the
            # named indexes at the top; a named pod below is deleted and recreated.
            count = job.replicas
            while count > replicas and count - 1 in indexes:
                count -= 1
        job = await asyncio.to_thread(
            self._patch_replicas, job_id, count, decision_id, f"{decision_id}:{count}"
        )
        for index, (name, uid) in sorted(doomed.items()):
            if index < count:
                await asyncio.to_thread(self._delete_pod, job, name, uid, decision_id)
        uids = {uid for _, uid in doomed.values()}
        settled = await self._wait_until(
            lambda: self._pods_gone(job, count, uids), self.settings.pod_wait_s
        )
        if not settled:
            logger.warning(
                "job %s: decision %d: the named pods were not gone within %.0f s: %s",
                job_id,
                decision_id,
                self.settings.pod_wait_s,
                self._pods_summary(job),
                extra={"job_id": job_id, "decision_id": decision_id},
            )

    def _delete_pod(self, job: JobView, name: str, uid: str, decision_id: int) -> None:
        check_still_leading(job.job_id, decision_id)
        try:
            raw(
                self.core.delete_namespaced_pod(
                    name,
                    job.namespace,
                    body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
                    # Raw, as every call here: the typed model refuses what some servers send.
                    _preload_content=False,
                    _request_timeout=self.settings.request_timeout_s,
                )
            )
        except HTTPError as exc:
            # Unknown whether it went: the retry finds it gone (404) or deletes it.
            raise _unreachable(job.job_id, exc) from None
        except ApiException as exc:
            # 404: gone already; 409: the name is the operator's replacement now.
            if exc.status in (404, 409):
                return
            raise _error(job.job_id, exc) from None
        logger.info(
            "job %s: decision %d: deleted pod %s (named by the decision; the operator"
            " recreates it as a spare)",
            job.job_id,
            decision_id,
            name,
            extra={"job_id": job.job_id, "decision_id": decision_id, "pod": name},
        )

    def _pods_gone(self, job: JobView, count: int, uids: set[str]) -> bool:
        if not self.capacity.pods.synced.is_set():
            return False
        return all(
            i < count and p["metadata"].get("uid") not in uids for i, p in self._pods(job).items()
        )

    def _patch_replicas(
        self, job_id: str, replicas: int, decision_id: int, removal: str = ""
    ) -> JobView:
        """Read, check, patch with the resourceVersion read; on 409 the same again.
        ``removal``: the REMOVAL annotation to write with the replicas."""
        ns, name = _split(job_id)
        for attempt in range(self.settings.conflict_retries + 1):
            check_still_leading(job_id, decision_id)
            job = self._read(job_id)
            epoch = owner_epoch()
            stored = _stored_epoch(job)
            if epoch is not None and stored > epoch:
                # The one case that is not an old leader: a store reset or restored from
                # a backup, whose epochs start again below what the PaddleJob carries.
                raise StaleEpoch(
                    f"job {job_id}: decision {decision_id}: the PaddleJob was last changed"
                    f" under owner epoch {stored}, this scaler holds {epoch}; not applied"
                    " (if the scaler's store was reset or restored from a backup, remove the"
                    f" annotation: kubectl annotate {_resource(job)} {name} -n {ns}"
                    f" {OWNER_EPOCH}-)"
                )
            self._recheck(job, replicas)
            if job.replicas == replicas and (
                not removal or job.annotations.get(REMOVAL) == removal
            ):
                return job  # done already (a resumed decision, or the retried patch landed)
            kind = job.kind
            # Conditional on the resourceVersion read: the epoch compared above is the
            # one this write replaces, or the write is a 409 and is compared again.
            patch = kind.replicas_patch(replicas, job.resource_version)
            annotations: dict[str, str] = {}
            if removal:
                annotations[REMOVAL] = removal
            if epoch is not None and epoch > stored:
                annotations[OWNER_EPOCH] = str(epoch)
            if annotations:
                patch["metadata"]["annotations"] = annotations
            try:
                self.custom.patch_namespaced_custom_object(
                    kind.group,
                    kind.version,
                    ns,
                    kind.plural,
                    name,
                    patch,
                    _request_timeout=self.settings.request_timeout_s,
                )
            except HTTPError as exc:
                # Whether the patch landed is unknown: the retry reads the job first,
                # and one that landed is not patched again.
                raise _unreachable(job_id, exc) from None
            except ApiException as exc:
                if exc.status != 409:
                    raise _error(job_id, exc) from None
                self.conflicts_retried += 1
                logger.warning(
                    "job %s: decision %d: PaddleJob changed since it was read (409, attempt %d);"
                    " reading it again",
                    job_id,
                    decision_id,
                    attempt + 1,
                    extra={"job_id": job_id, "decision_id": decision_id},
                )
                continue
            logger.info(
                "job %s: decision %d: PaddleJob (%s) worker replicas %d -> %d",
                job_id,
                decision_id,
                kind.name,
                job.replicas,
                replicas,
                extra={"job_id": job_id, "decision_id": decision_id},
            )
            return job
        raise Unavailable(
            f"job {job_id}: the PaddleJob kept changing under the resize"
            f" ({self.settings.conflict_retries + 1} conflicts in a row)"
        )

    @staticmethod
    def _recheck(job: JobView, replicas: int) -> None:
        """What a 409 may have changed that makes the change wrong now."""
        if not job.opted_in:
            raise FailedPrecondition(f"job {job.job_id}: the PaddleJob is no longer opted in")
        lo, hi = job.min_replicas, job.max_replicas
        if replicas and ((lo is not None and replicas < lo) or (hi is not None and replicas > hi)):
            raise FailedPrecondition(
                f"job {job.job_id}: {replicas} replica(s) is outside the PaddleJob's bounds"
                f" [{lo}, {hi}] now"
            )

    # -- pods ---------------------------------------------------------------------------

    def _pods(self, job: JobView) -> dict[int, dict[str, Any]]:
        out = {}
        for p in self.capacity.pods.objects():
            meta = p.get("metadata", {})
            idx = pod_index(meta.get("name", ""))
            if meta.get("namespace") == job.namespace and idx is not None and owned_by(p, job.uid):
                out[idx] = p
        return out

    def _pods_match(self, job: JobView, replicas: int) -> bool:
        if not self.capacity.pods.synced.is_set():
            return False
        pods = self._pods(job)
        # A new pod counts once the scheduler has placed it or said it cannot (the
        # cluster is full: the coordinator's deadline decides, not this wait).
        live = {
            i
            for i, p in pods.items()
            if not p["metadata"].get("deletionTimestamp") and _considered(p)
        }
        return set(range(replicas)) <= live and all(i < replicas for i in pods)

    def _pods_summary(self, job: JobView) -> str:
        pods = self._pods(job)
        return (
            ", ".join(
                f"{i}:{'terminating' if p['metadata'].get('deletionTimestamp') else p.get('status', {}).get('phase', '?')}"
                for i, p in sorted(pods.items())
            )
            or "no pods"
        )
