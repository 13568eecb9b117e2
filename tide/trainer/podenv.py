"""Who this launcher is, from a Kubernetes pod's environment (Downward API).

Both PaddleJob operators name worker ``i`` of job ``NAME`` ``NAME-worker-i``
(paddle-operator also sets ``PADDLE_TRAINER_ID`` to ``i``; Kubeflow puts it in
the ``training.kubeflow.org/replica-index`` label, which a Downward API env
var can carry). The PaddleJob's worker container sets, with ``fieldRef``:
``POD_NAME`` (metadata.name), ``POD_NAMESPACE`` (metadata.namespace) and
``POD_IP`` (status.podIP), and plainly ``TIDE_COORDINATOR`` (the coordinator's
Service). From those the launcher knows its pod, its index and its job
(``NAMESPACE/NAME``), unless ``TIDE_POD_INDEX`` / ``TIDE_JOB`` say otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The env names read, in the order they are tried.
INDEX_VARS = ("TIDE_POD_INDEX", "PADDLE_TRAINER_ID", "TIDE_REPLICA_INDEX")


@dataclass(frozen=True)
class PodIdentity:
    pod_name: str
    pod_index: int | None
    job_id: str  # "" when the environment does not tell


def worker_of(pod_name: str) -> tuple[str, int] | None:
    """(job name, index) of an operator's worker pod ``NAME-worker-i``."""
    head, sep, tail = pod_name.rpartition("-worker-")
    if sep and head and tail.isdigit():
        return head, int(tail)
    return None


def pod_identity(env: Mapping[str, str], default_name: str) -> PodIdentity:
    name = env.get("POD_NAME") or default_name
    parsed = worker_of(name)
    index: int | None = None
    for var in INDEX_VARS:
        raw = env.get(var, "").strip()
        if raw.isdigit():
            index = int(raw)
            break
    if index is None and parsed is not None:
        index = parsed[1]
    job = env.get("TIDE_JOB", "")
    if not job and parsed is not None and env.get("POD_NAMESPACE"):
        job = f"{env['POD_NAMESPACE']}/{parsed[0]}"
    return PodIdentity(name, index, job)
