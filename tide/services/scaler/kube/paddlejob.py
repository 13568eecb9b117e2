"""PaddleJobs as the scaler reads them: pure functions over the API's JSON, no I/O.

The two kinds users run:

- paddle-operator's ``batch.paddlepaddle.org/v1``: replicas in
  ``spec.worker.replicas``; ``spec.worker.requests`` and ``limits`` are
  declared as the minimal and maximal replicas (the operator never reads
  them; Tide does);
- Kubeflow training-operator's ``kubeflow.org/v1``: replicas in
  ``spec.paddleReplicaSpecs.Worker.replicas``, bounds in ``spec.elasticPolicy``
  (whose ``metrics``, when set, would make the operator create an HPA).

Both operators name worker ``i`` of job ``N`` ``N-worker-i`` and remove the
highest indexes on a shrink.

Opt-in and policy overrides are annotations under Tide's prefix (docs/install.md):
``tide.dev/autoscale: "true"`` and ``tide.dev/<setting-with-dashes>``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tide.base.errors import ConfigError
from tide.services.scaler.policy import PolicySettings

Obj = Mapping[str, Any]

PREFIX = "tide.dev/"
OPT_IN = PREFIX + "autoscale"
GPU = "nvidia.com/gpu"
#: PolicySettings fields an annotation may set; the bounds come from the PaddleJob itself.
OVERRIDABLE = tuple(
    f.name
    for f in dataclasses.fields(PolicySettings)
    if f.name not in ("min_replicas", "max_replicas")
)


@dataclass(frozen=True)
class Kind:
    """One PaddleJob CRD: where its worker replicas live, how its pods are labelled."""

    name: str  # short, for messages and flags
    group: str
    version: str
    plural: str
    #: Path of the worker ResourceSpec / ReplicaSpec in the object.
    worker_path: tuple[str, ...]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def worker(self, obj: Obj) -> Obj:
        cur: Any = obj
        for part in self.worker_path:
            cur = cur.get(part) if isinstance(cur, Mapping) else None
        return cur if isinstance(cur, Mapping) else {}

    def replicas_patch(self, replicas: int, resource_version: str) -> dict[str, Any]:
        """The merge patch that sets the worker replicas, conditional on ``resource_version``."""
        body: dict[str, Any] = {"replicas": replicas}
        for part in reversed(self.worker_path):
            body = {part: body}
        return {"metadata": {"resourceVersion": resource_version}, **body}


PADDLE_OPERATOR = Kind(
    "paddle-operator",
    "batch.paddlepaddle.org",
    "v1",
    "paddlejobs",
    ("spec", "worker"),
)
KUBEFLOW = Kind(
    "kubeflow",
    "kubeflow.org",
    "v1",
    "paddlejobs",
    ("spec", "paddleReplicaSpecs", "Worker"),
)
KINDS = (PADDLE_OPERATOR, KUBEFLOW)


def pod_index(pod_name: str) -> int | None:
    """The worker index in a pod's name (``N-worker-i``), None for another pod."""
    head, sep, tail = pod_name.rpartition("-worker-")
    return int(tail) if sep and head and tail.isdigit() else None


def owned_by(pod: Obj, uid: str) -> bool:
    refs = pod.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


class Refusal(enum.Enum):
    """Why Tide will not autoscale a PaddleJob."""

    HPA_TARGETS_JOB = "an HPA already targets this PaddleJob"
    KUBEFLOW_METRICS = "spec.elasticPolicy.metrics is set (the operator would create an HPA)"
    BAD_BOUNDS = "the PaddleJob's replica bounds are invalid"
    NAME_TAKEN = "a PaddleJob of the other kind has the same namespace and name"


@dataclass(frozen=True)
class JobView:
    """What the scaler takes from one PaddleJob."""

    job_id: str  # NAMESPACE/NAME
    kind: Kind
    namespace: str
    name: str
    uid: str
    resource_version: str
    opted_in: bool
    replicas: int
    min_replicas: int | None
    max_replicas: int | None
    gpus_per_replica: int
    annotations: Mapping[str, str]
    has_metrics: bool

    def ref(self) -> dict[str, str]:
        """The Event's involvedObject."""
        return {
            "apiVersion": self.kind.api_version,
            "kind": "PaddleJob",
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": self.resource_version,
        }


def _int_or_none(v: Any) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def spec_gpus(spec: Mapping[str, Any]) -> int:
    """GPUs of a pod spec: the sum of its containers' nvidia.com/gpu (limits, else
    requests; a value that is no number counts 0); init containers run before them
    and are not counted."""
    n = 0
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        n += (
            _int_or_none((res.get("limits") or {}).get(GPU, (res.get("requests") or {}).get(GPU)))
            or 0
        )
    return n


def gpus_of(worker: Obj) -> int:
    """GPUs of one worker pod: :func:`spec_gpus` of its template; at least 1, since a
    replica is what Tide counts."""
    return max(1, spec_gpus((worker.get("template") or {}).get("spec") or {}))


def view(kind: Kind, obj: Obj) -> JobView:
    meta = obj.get("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    worker = kind.worker(obj)
    if kind is KUBEFLOW:
        elastic = obj.get("spec", {}).get("elasticPolicy") or {}
        lo, hi = _int_or_none(elastic.get("minReplicas")), _int_or_none(elastic.get("maxReplicas"))
        has_metrics = bool(elastic.get("metrics"))
    else:
        lo, hi = _int_or_none(worker.get("requests")), _int_or_none(worker.get("limits"))
        has_metrics = False
    return JobView(
        job_id=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        kind=kind,
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        resource_version=str(meta.get("resourceVersion", "")),
        opted_in=annotations.get(OPT_IN, "").lower() == "true",
        replicas=_int_or_none(worker.get("replicas")) or 0,
        min_replicas=lo,
        max_replicas=hi,
        gpus_per_replica=gpus_of(worker),
        annotations=annotations,
        has_metrics=has_metrics,
    )


def hpa_targets(hpa: Obj, job: JobView) -> bool:
    """True when ``hpa`` (autoscaling/v2 or v1) scales ``job``."""
    meta = hpa.get("metadata", {})
    ref = hpa.get("spec", {}).get("scaleTargetRef") or {}
    group = str(ref.get("apiVersion", "")).rpartition("/")[0]
    return (
        meta.get("namespace") == job.namespace
        and ref.get("kind") == "PaddleJob"
        and ref.get("name") == job.name
        and group == job.kind.group
    )


@dataclass(frozen=True)
class Overrides:
    """Policy overrides read from a job's annotations, and what was wrong with the rest."""

    values: dict[str, Any]
    errors: tuple[str, ...] = ()


def _parse(name: str, raw: str) -> Any:
    field = next(f for f in dataclasses.fields(PolicySettings) if f.name == name)
    if field.type in (str, "str"):
        return raw.strip()  # the signal; PolicySettings checks its value
    try:
        return int(raw) if field.type in (int, "int") else float(raw)
    except ValueError:
        raise ConfigError(f"{PREFIX}{name.replace('_', '-')}={raw!r}: not a number") from None


def overrides_from(annotations: Mapping[str, str], base: PolicySettings) -> Overrides:
    """``tide.dev/<setting-with-dashes>`` annotations as policy overrides. Each is parsed
    and checked on its own and then together with the others over ``base``; the ones
    that fail are left out and named in ``errors`` (the scaler posts them as a Warning)."""
    values: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in sorted(annotations.items()):
        if not key.startswith(PREFIX) or key == OPT_IN:
            continue
        name = key[len(PREFIX) :].replace("-", "_")
        if name not in OVERRIDABLE:
            errors.append(f"{key}: not a policy setting (one of: {', '.join(OVERRIDABLE)})")
            continue
        try:
            value = _parse(name, raw)
            base.with_overrides({name: value})
        except ConfigError as exc:
            errors.append(f"{key}={raw!r}: {exc}")
            continue
        values[name] = value
    if values:
        try:
            base.with_overrides(values)
        except ConfigError as exc:
            errors.append(f"together: {exc}; no override applied")
            values = {}
    return Overrides(values, tuple(errors))


def check_bounds(job: JobView, base: PolicySettings) -> str | None:
    """Why the job's bounds cannot be used (None when they can): the replicas it runs
    must lie within them."""
    lo = job.min_replicas if job.min_replicas is not None else base.min_replicas
    hi = job.max_replicas if job.max_replicas is not None else base.max_replicas
    if lo < 1 or hi < lo:
        return f"min replicas {lo} and max replicas {hi}: need 1 <= min <= max"
    if job.replicas and not lo <= job.replicas <= hi:
        return f"replicas {job.replicas} outside [{lo}, {hi}]"
    return None
