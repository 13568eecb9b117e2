"""Jobs found from the cluster: the scaler keeps its jobs in step with the PaddleJobs
that opt in (``tide.dev/autoscale: "true"``).

Level-triggered: reflectors (list, then watch; re-list on 410) keep the
PaddleJobs of both kinds and the HPAs; any change wakes :meth:`Discovery.run`,
which compares what each PaddleJob asks for with what it last applied and
calls the scaler for the difference:

- a new opted-in PaddleJob becomes a job (``NAMESPACE/NAME``) with the
  PaddleJob's bounds and GPUs per worker; one already running pods starts
  with a JOB_STARTED decision at its replicas, which forms its first
  generation (the same path as ``UpsertJob`` with initial replicas);
- bounds, GPUs or ``tide.dev/<setting>`` overrides changed: the job is
  updated; overrides that do not parse or do not fit are left out and named
  in a Warning Event (``InvalidPolicyAnnotation``);
- refused (an HPA targets the PaddleJob, or a Kubeflow ``elasticPolicy.metrics``
  would make the operator create one): the job stays (its trainers still need
  their generations) but its autoscaling is paused with the reason as its
  status, and a Warning Event (``AutoscalerConflict``) says why; resumed when
  the conflict goes away;
- deleted, or the opt-in removed: autoscaling is paused with that reason; the
  job's decisions and history stay in SQL.

Pauses discovery makes carry the ``kubernetes:`` prefix, so it lifts only its own.
``UpsertJob`` keeps working for jobs without a PaddleJob.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client

from tide.base.errors import TideError
from tide.services.scaler.kube import events as ev
from tide.services.scaler.kube.client import Reflector
from tide.services.scaler.kube.events import EventRecorder, EventSpec
from tide.services.scaler.kube.paddlejob import (
    KINDS,
    JobView,
    Kind,
    Refusal,
    check_bounds,
    hpa_targets,
    overrides_from,
    view,
)
from tide.services.scaler.kube.trust import TrustBundle
from tide.services.scaler.policy import PolicySettings
from tide.services.scaler.store import JobRecord

logger = logging.getLogger(__name__)

#: Prefix of the pause reasons discovery sets (and the only ones it lifts).
PAUSE_PREFIX = "kubernetes: "


class JobSink(Protocol):
    """What discovery needs of the scaler (ScalerCore)."""

    jobs: dict[str, JobRecord]
    defaults: PolicySettings

    async def upsert_job(
        self,
        job_id: str,
        overrides: Mapping[str, Any],
        *,
        initial_replicas: int = 0,
        gpus_per_replica: int = 0,
        clear: Sequence[str] = (),
    ) -> JobRecord: ...

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> JobRecord: ...


class KindTeller(Protocol):
    def know(self, job_id: str, kind: Kind) -> None: ...


@dataclass(frozen=True)
class _Wanted:
    """What one PaddleJob asks of the scaler; compared with what was last applied."""

    kind: Kind
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int
    overrides: tuple[tuple[str, Any], ...]
    override_errors: tuple[str, ...]
    refusal: str


class Discovery:
    def __init__(
        self,
        api: client.ApiClient,
        sink: JobSink,
        recorder: EventRecorder,
        *,
        actuator: KindTeller | None = None,
        namespaces: Sequence[str] = (),
        watch_timeout_s: int = 60,
        trust: TrustBundle | None = None,
    ) -> None:
        self.sink = sink
        # The CA copied into each namespace with an opted-in PaddleJob (tide/services/scaler/kube/trust.py).
        self.trust = trust
        self.recorder = recorder
        self.actuator = actuator
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        custom = client.CustomObjectsApi(api)
        hpas = client.AutoscalingV2Api(api)
        self.jobs: list[tuple[Kind, Reflector]] = []
        self.hpas: list[Reflector] = []
        for kind in KINDS:
            for ns in namespaces or (None,):
                fn: Callable[..., Any]
                if ns is None:
                    args: tuple[Any, ...] = (kind.group, kind.version, kind.plural)
                    fn = custom.list_cluster_custom_object
                else:
                    args = (kind.group, kind.version, ns, kind.plural)
                    fn = custom.list_namespaced_custom_object
                r = Reflector(
                    f"{kind.name}:{ns or '*'}",
                    fn,
                    *args,
                    on_change=self._changed,
                    watch_timeout_s=watch_timeout_s,
                )
                self.jobs.append((kind, r))
        for ns in namespaces or (None,):
            if ns is None:
                h = Reflector(
                    "hpas:*",
                    hpas.list_horizontal_pod_autoscaler_for_all_namespaces,
                    on_change=self._changed,
                    watch_timeout_s=watch_timeout_s,
                )
            else:
                h = Reflector(
                    f"hpas:{ns}",
                    hpas.list_namespaced_horizontal_pod_autoscaler,
                    ns,
                    on_change=self._changed,
                    watch_timeout_s=watch_timeout_s,
                )
            self.hpas.append(h)
        #: What was last applied per job; jobs seen as PaddleJobs in this process.
        self.applied: dict[str, _Wanted] = {}
        #: Each managed job's PaddleJob, for its Events.
        self.views: dict[str, JobView] = {}
        self._warned: dict[str, tuple[str, ...]] = {}

    # -- the loop -----------------------------------------------------------------------

    def _changed(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        """Keep the scaler's jobs in step until cancelled."""
        self._loop = asyncio.get_running_loop()
        reflectors = [r for _, r in self.jobs] + self.hpas
        for r in reflectors:
            r.start()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self.resync()
        finally:
            for r in reflectors:
                r.stop()

    def ref(self, job_id: str) -> dict[str, str] | None:
        """The Event reference of a managed job's PaddleJob; None for other jobs."""
        v = self.views.get(job_id)
        return v.ref() if v is not None else None

    def event(self, job_id: str, spec: EventSpec) -> None:
        ref = self.ref(job_id)
        if ref is not None:
            self.recorder.post(ref, spec)

    # -- one pass -----------------------------------------------------------------------

    def _views(self) -> dict[str, JobView]:
        found: dict[str, JobView] = {}
        for kind, r in self.jobs:
            for obj in r.objects():
                v = view(kind, obj)
                if not v.opted_in:
                    continue
                other = found.get(v.job_id)
                if other is not None and other.kind is not kind:
                    # Two kinds, one job id: the one seen first keeps it.
                    self._warn_once(v, ev.AUTOSCALER_CONFLICT, (Refusal.NAME_TAKEN.value,))
                    continue
                found[v.job_id] = v
        return found

    def _refusal(self, v: JobView) -> str:
        for h in self.hpas:
            for hpa in h.objects():
                if hpa_targets(hpa, v):
                    return f"{Refusal.HPA_TARGETS_JOB.value} ({hpa['metadata']['name']})"
        if v.has_metrics:
            return Refusal.KUBEFLOW_METRICS.value
        return ""

    async def resync(self) -> None:
        """Apply what changed since the last pass; one job's failure stops only that job."""
        if not all(r.synced.is_set() for _, r in self.jobs) or not all(
            h.synced.is_set() for h in self.hpas
        ):
            return  # a partial picture would read as deletions
        views = self._views()
        if self.trust is not None:
            await self.trust.ensure(job_id.partition("/")[0] for job_id in views)
        for job_id, v in views.items():
            try:
                await self._apply(v)
            except TideError as exc:
                logger.warning(
                    "job %s: PaddleJob not applied: %s", job_id, exc, extra={"job_id": job_id}
                )
        for job_id in [j for j in self.applied if j not in views]:
            try:
                await self._release(job_id)
            except TideError as exc:
                logger.warning("job %s: release failed: %s", job_id, exc, extra={"job_id": job_id})

    async def _apply(self, v: JobView) -> None:
        base = self.sink.defaults
        bad = check_bounds(v, base)
        if bad is not None:
            self._warn_once(v, ev.INVALID_BOUNDS, (bad,))
            if v.job_id in self.sink.jobs:
                await self._pause(v.job_id, f"{Refusal.BAD_BOUNDS.value}: {bad}")
            return
        lo = v.min_replicas if v.min_replicas is not None else base.min_replicas
        hi = v.max_replicas if v.max_replicas is not None else base.max_replicas
        ov = overrides_from(
            v.annotations, base.with_overrides({"min_replicas": lo, "max_replicas": hi})
        )
        wanted = _Wanted(
            v.kind,
            lo,
            hi,
            v.gpus_per_replica,
            tuple(sorted(ov.values.items())),
            ov.errors,
            self._refusal(v),
        )
        self.views[v.job_id] = v
        if self.actuator is not None:
            self.actuator.know(v.job_id, v.kind)
        before = self.applied.get(v.job_id)
        if before == wanted and v.job_id in self.sink.jobs:
            return
        if ov.errors:
            self._warn_once(v, ev.INVALID_ANNOTATION, ov.errors)
        new = v.job_id not in self.sink.jobs
        old_keys = {k for k, _ in before.overrides} if before else set()
        if new:
            # Before the upsert: a new job's first decision posts its own Events at once.
            self.recorder.post(
                v.ref(),
                EventSpec(
                    ev.NORMAL,
                    ev.ADOPTED,
                    f"autoscaled by Tide as job {v.job_id}: replicas {lo}..{hi}",
                ),
            )
        await self.sink.upsert_job(
            v.job_id,
            {"min_replicas": lo, "max_replicas": hi, **ov.values},
            initial_replicas=v.replicas if new else 0,
            gpus_per_replica=v.gpus_per_replica,
            clear=sorted(old_keys - set(ov.values)),
        )
        self.applied[v.job_id] = wanted
        job = self.sink.jobs[v.job_id]
        if wanted.refusal:
            reason = f"{PAUSE_PREFIX}refused: {wanted.refusal}"
            if not (job.autoscaling_paused and job.pause_reason == reason):
                await self.sink.set_autoscaling(v.job_id, True, reason)
                self.recorder.post(
                    v.ref(),
                    EventSpec(
                        ev.WARNING,
                        ev.AUTOSCALER_CONFLICT,
                        f"Tide will not resize this PaddleJob: {wanted.refusal}; two autoscalers"
                        " would fight over its replicas",
                    ),
                )
        elif job.autoscaling_paused and job.pause_reason.startswith(PAUSE_PREFIX):
            await self.sink.set_autoscaling(v.job_id, False, "")

    async def _pause(self, job_id: str, why: str) -> None:
        job = self.sink.jobs.get(job_id)
        reason = PAUSE_PREFIX + why
        if job is not None and not (job.autoscaling_paused and job.pause_reason == reason):
            await self.sink.set_autoscaling(job_id, True, reason)

    async def _release(self, job_id: str) -> None:
        """The PaddleJob is gone or opted out: its job stops being autoscaled."""
        self.applied.pop(job_id, None)
        v = self.views.pop(job_id, None)
        await self._pause(job_id, "the PaddleJob was deleted or no longer opts in")
        if v is not None:
            # Posted on the last known object: for a deleted one the Event goes with it.
            self.recorder.post(
                v.ref(), EventSpec(ev.NORMAL, ev.RELEASED, "no longer autoscaled by Tide")
            )

    def _warn_once(self, v: JobView, reason: str, errors: tuple[str, ...]) -> None:
        if self._warned.get(v.job_id + reason) == errors:
            return
        self._warned[v.job_id + reason] = errors
        self.recorder.post(v.ref(), EventSpec(ev.WARNING, reason, "; ".join(errors)))
