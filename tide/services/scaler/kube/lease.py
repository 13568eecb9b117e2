"""The scaler's leader lease as a ``coordination.k8s.io/v1`` Lease.

The same compare-and-set as the lease row in SQL (tide/services/store/leases.py),
over the API server: the Lease is read, then renewed by its holder, taken once
expired (``renewTime + leaseDurationSeconds`` has passed, or ``holderIdentity``
is empty after a release), or left alone. Every write is a replace carrying the
resourceVersion that was read, so of two replicas taking an expired Lease at
once exactly one succeeds; the other gets 409 Conflict (it lost the race), reads
again and finds the winner. ``leaseTransitions`` counts the takes: the lease
epoch is ``leaseTransitions + 1``, as the SQL row's epoch starts at 1.

The lease only says who leads. What refuses a paused old leader's writes is the
fencing epoch of every job in SQL: the new leader takes every job (a new owner
epoch each) before it acts, and the store refuses a write carrying an older one.

Times are the holders' wall clocks, as with the SQL lease: replicas must agree
within a fraction of the lease (NTP does). The client is synchronous; each call
runs in a worker thread with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tide.base.errors import InvalidArgument, PermissionDenied, TideError, Unavailable
from tide.services.common.clock import Clock
from tide.services.scaler.kube.client import Obj, raw
from tide.services.store.leases import LeaseRecord

logger = logging.getLogger(__name__)

#: Where the holder writes the address other replicas and errors name for it.
ADDRESS_ANNOTATION = "tide.dev/leader-address"

#: Tries of one renewal or take when another writer moves the resourceVersion on.
_CONFLICT_TRIES = 3

_NEVER = datetime.min.replace(tzinfo=UTC)


def micro_time(t: datetime) -> str:
    """A ``MicroTime`` as the API server writes it."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: Any) -> datetime:
    if not value:
        return _NEVER
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _expires(spec: Obj) -> datetime:
    renewed = _parse(spec.get("renewTime"))
    if renewed == _NEVER:
        return _NEVER
    return renewed + timedelta(seconds=int(spec.get("leaseDurationSeconds") or 0))


def record(obj: Obj) -> LeaseRecord:
    spec = obj.get("spec") or {}
    meta = obj.get("metadata") or {}
    return LeaseRecord(
        name=str(meta.get("name", "")),
        holder=str(spec.get("holderIdentity") or ""),
        address=str((meta.get("annotations") or {}).get(ADDRESS_ANNOTATION, "")),
        epoch=int(spec.get("leaseTransitions") or 0) + 1,
        acquired_at=_parse(spec.get("acquireTime")),
        expires_at=_expires(spec),
    )


def _seconds(duration_s: float) -> int:
    # The Lease counts whole seconds; rounding up never shortens what the holder counts on.
    return max(1, int(-(-duration_s // 1)))


def _error(what: str, exc: ApiException) -> TideError:
    text = f"{what}: Kubernetes API: {exc.status} {exc.reason}"
    if exc.status in (401, 403):
        return PermissionDenied(text)
    if exc.status in (400, 422):
        return InvalidArgument(text)
    return Unavailable(text)


class KubernetesLease:
    """A lease backend of :class:`tide.services.scaler.leases.LeaderElector` on a Lease in
    ``namespace``; ``owner_id`` is its ``holderIdentity``."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        owner_id: str,
        clock: Clock,
        *,
        request_timeout_s: float = 5.0,
    ) -> None:
        if not namespace:
            raise InvalidArgument("lease namespace must not be empty")
        if not owner_id:
            raise InvalidArgument("lease holder must not be empty")
        # Bodies are plain JSON (tide/services/scaler/kube/client.py), which the client sends
        # as they are; its type stubs only know the typed models.
        self.coordination: Any = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.owner_id = owner_id
        self.clock = clock
        self.request_timeout_s = request_timeout_s

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock.now(), UTC)

    async def try_lease(self, name: str, address: str, *, duration_s: float) -> LeaseRecord:
        """Renew the Lease if this replica holds it, take it if it expired (or never
        existed); returns it as it stands after, whoever holds it."""
        if not duration_s > 0:
            raise InvalidArgument(f"lease duration_s must be > 0, got {duration_s!r}")
        return await asyncio.to_thread(self._call, name, self._try, name, address, duration_s)

    async def release_lease(self, name: str) -> bool:
        """Let the Lease go at once (a clean shutdown), if this replica holds it."""
        return await asyncio.to_thread(self._call, name, self._release, name)

    def _call(self, name: str, fn: Any, *args: Any) -> Any:
        what = f"lease {self.namespace}/{name}"
        try:
            return fn(*args)
        except ApiException as exc:
            raise _error(what, exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unavailable(f"{what}: Kubernetes API unreachable: {exc}") from None

    def _read(self, name: str) -> Obj | None:
        try:
            return raw(
                self.coordination.read_namespaced_lease(
                    name,
                    self.namespace,
                    _preload_content=False,
                    _request_timeout=self.request_timeout_s,
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _spec(self, address: str, duration_s: float, now: datetime) -> tuple[Obj, Obj]:
        meta: Obj = {"annotations": {ADDRESS_ANNOTATION: address}}
        spec: Obj = {
            "holderIdentity": self.owner_id,
            "leaseDurationSeconds": _seconds(duration_s),
            "renewTime": micro_time(now),
        }
        return meta, spec

    def _try(self, name: str, address: str, duration_s: float) -> LeaseRecord:
        for _ in range(_CONFLICT_TRIES):
            now = self._now()
            current = self._read(name)
            meta, spec = self._spec(address, duration_s, now)
            if current is None:
                meta["name"] = name
                spec.update(acquireTime=micro_time(now), leaseTransitions=0)
                body: Obj = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": meta,
                    "spec": spec,
                }
                try:
                    created = raw(
                        self.coordination.create_namespaced_lease(
                            self.namespace,
                            body,
                            _preload_content=False,
                            _request_timeout=self.request_timeout_s,
                        )
                    )
                except ApiException as exc:
                    if exc.status == 409:
                        continue  # another replica created it first: read theirs
                    raise
                logger.info("%s: lease %s created (epoch 1)", self.owner_id, name)
                return record(created)
            old = current.get("spec") or {}
            holder = old.get("holderIdentity") or ""
            expired = _expires(old) <= now
            if holder == self.owner_id and not expired:
                spec.update(
                    acquireTime=old.get("acquireTime"),
                    leaseTransitions=int(old.get("leaseTransitions") or 0),
                )
            elif not holder or expired:
                # Every take is a new epoch, the same holder's after an expiry too.
                spec.update(
                    acquireTime=micro_time(now),
                    leaseTransitions=int(old.get("leaseTransitions") or 0) + 1,
                )
            else:
                return record(current)
            body = dict(current)
            body["metadata"] = {
                **current["metadata"],
                "annotations": {
                    **(current["metadata"].get("annotations") or {}),
                    **meta["annotations"],
                },
            }
            body["spec"] = {**old, **spec}
            try:
                replaced = raw(
                    self.coordination.replace_namespaced_lease(
                        name,
                        self.namespace,
                        body,
                        _preload_content=False,
                        _request_timeout=self.request_timeout_s,
                    )
                )
            except ApiException as exc:
                if exc.status == 409:
                    continue  # someone wrote since the read: decide again on what is there now
                raise
            taken = record(replaced)
            if holder != self.owner_id or expired:
                logger.info(
                    "%s: lease %s taken from %s (epoch %d)",
                    self.owner_id,
                    name,
                    holder or "nobody",
                    taken.epoch,
                )
            return taken
        raise Unavailable(
            f"lease {self.namespace}/{name}: {_CONFLICT_TRIES} conflicting writes in a row"
        )

    def _release(self, name: str) -> bool:
        current = self._read(name)
        if current is None:
            return False
        spec = current.get("spec") or {}
        now = self._now()
        if spec.get("holderIdentity") != self.owner_id or _expires(spec) <= now:
            return False
        # As client-go releases: no holder, so the next try of any replica takes it.
        body = dict(current)
        body["spec"] = {
            **spec,
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "renewTime": micro_time(now),
        }
        try:
            self.coordination.replace_namespaced_lease(
                name,
                self.namespace,
                body,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status == 409:
                return False  # written since the read: not ours to clear; it runs out
            raise
        return True
