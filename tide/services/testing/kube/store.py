"""The API server emulator's object store: one cluster-wide resourceVersion counter
(etcd's revision), the objects by (group, plural, namespace, name), the served types,
and the writes with the real server's rules (409 on a stale resourceVersion, the
fields a client cannot change, ``metadata.generation``, the status subresource,
graceful pod deletion, finalizers, a namespace's deletion taking its objects along).

Its own room because these rules change together, and apart from the HTTP edge
(``wire.py``) and the watches (``watch.py``): every write records its change in the
history that the watches replay. Also the API that stand-ins in the same process use.
"""

from __future__ import annotations

import collections
import copy
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tide.services.testing.kube.resources import BUILTINS, ResourceType, crd_resource_types
from tide.services.testing.kube.semantics import (
    ApiError,
    Obj,
    field_matcher,
    json_patch,
    label_matcher,
    merge_patch,
    strategic_merge_patch,
)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Change:
    """One write as the history keeps it, for the watches (``watch.py``) to replay."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    rtype: ResourceType
    obj: Obj


@dataclass
class Stats:
    """What the tests count: requests by verb, conflicts answered, watches ended by 410."""

    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    conflicts: int = 0
    # Of those, the ones a test asked for (conflict_next); the rest were real races.
    injected_conflicts: int = 0
    gone: int = 0
    lists: int = 0  # collection GETs
    watches: int = 0  # watch requests


class ObjectStore:
    """The objects, their types and their history, behind one condition variable that
    every write notifies (watches and in-process stand-ins wait on it)."""

    def __init__(self, *, history: int = 1000) -> None:
        self._cond = threading.Condition()
        self._rv = 1
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._objects: dict[tuple[str, str, str, str], Obj] = {}  # (group, plural, ns, name)
        self._history: collections.deque[_Change] = collections.deque(maxlen=history)
        self._oldest_rv = 1  # watches from before this get 410
        self._conflicts: dict[str, int] = {}
        self._conflict_changes: dict[str, Callable[[Obj], Obj]] = {}
        self._watch_epoch = 0
        self.blackhole = False
        self._closing = False
        self.stats = Stats()
        for t in BUILTINS:
            self.register(t)
        self.create(ResourceType("", "v1", "namespaces", "Namespace", False), _ns("default"))

    # -- faults ---------------------------------------------------------------------------

    def conflict_next(
        self, plural: str, n: int = 1, change: Callable[[Obj], Obj] | None = None
    ) -> None:
        """The next ``n`` updates or patches of ``plural`` get 409, as if another writer
        changed the object first: its resourceVersion moves on, and ``change`` (if
        given) is what that writer did to it."""
        with self._cond:
            self._conflicts[plural] = self._conflicts.get(plural, 0) + n
            if change is not None:
                self._conflict_changes[plural] = change

    @property
    def resource_version(self) -> int:
        return self._rv

    def wait_changed(self, since: int, timeout_s: float) -> int:
        """Block until the cluster's resourceVersion passes ``since`` (or the server
        closes, or ``timeout_s`` passes); the current one. For in-process stand-ins."""
        with self._cond:
            self._cond.wait_for(lambda: self._closing or self._rv > since, timeout=timeout_s)
            return self._rv

    # -- types ----------------------------------------------------------------------------

    def register(self, t: ResourceType) -> None:
        with self._cond:
            self._types[(t.group, t.version, t.plural)] = t

    def types(self) -> list[ResourceType]:
        with self._cond:
            return list(self._types.values())

    def rtype(self, group: str, version: str, plural: str) -> ResourceType:
        t = self._types.get((group, version, plural))
        if t is None:
            gv = f"{group}/{version}" if group else version
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({gv} {plural})"
            )
        return t

    def type_of_kind(self, api_version: str, kind: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        for t in self.types():
            if (t.group, t.version, t.kind) == (group, version, kind):
                return t
        raise ApiError(404, "NotFound", f"no kind {kind!r} in {api_version}")

    def _crd_changed(self, crd: Obj, deleted: bool) -> None:
        for t in crd_resource_types(crd):
            key = (t.group, t.version, t.plural)
            if deleted:
                self._types.pop(key, None)
            else:
                self._types[key] = t

    # -- objects (also the API for stand-ins in the same process) --------------------------

    def _key(self, t: ResourceType, ns: str, name: str) -> tuple[str, str, str, str]:
        return (t.group, t.plural, ns if t.namespaced else "", name)

    def _record(self, kind: str, t: ResourceType, obj: Obj) -> None:
        self._history.append(_Change(self._rv, kind, t, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _stamp(self, t: ResourceType, obj: Obj) -> Obj:
        obj["apiVersion"] = t.group_version
        obj["kind"] = t.kind
        return obj

    def get(self, t: ResourceType, ns: str, name: str) -> Obj:
        with self._cond:
            obj = self._objects.get(self._key(t, ns, name))
            if obj is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'{t.plural}{"." + t.group if t.group else ""} "{name}" not found',
                )
            return copy.deepcopy(obj)

    def list(
        self, t: ResourceType, ns: str = "", labels: str = "", fields: str = ""
    ) -> tuple[list[Obj], int]:
        lm, fm = label_matcher(labels), field_matcher(fields)
        with self._cond:
            items = [
                copy.deepcopy(o)
                for (g, p, ons, _), o in sorted(self._objects.items())
                if (g, p) == (t.group, t.plural)
                and (not ns or ons == ns)
                and lm(o["metadata"].get("labels") or {})
                and fm(o)
            ]
            return items, self._rv

    def create(self, t: ResourceType, obj: Obj, ns: str = "") -> Obj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if t.namespaced:
            ns = ns or meta.get("namespace") or "default"
            if meta.get("namespace") not in (None, "", ns):
                raise ApiError(
                    400, "BadRequest", "the namespace of the object does not match the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        with self._cond:
            if t.namespaced and ("", "namespaces", "", ns) not in self._objects:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
            if not meta.get("name"):
                gen = meta.get("generateName")
                if not gen:
                    raise ApiError(
                        422,
                        "Invalid",
                        "metadata.name: Required value: name or generateName is required",
                    )
                meta["name"] = gen + uuid.uuid4().hex[:5]
            key = self._key(t, ns, meta["name"])
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{t.plural} "{meta["name"]}" already exists')
            self._rv += 1
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = str(self._rv)
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            meta.pop("deletionTimestamp", None)
            self._stamp(t, obj)
            if t.kind == "Pod":
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            if t.kind == "Namespace":
                obj.setdefault("status", {"phase": "Active"})
            self._objects[key] = obj
            if t.kind == "CustomResourceDefinition":
                self._crd_changed(obj, deleted=False)
            self._record("ADDED", t, obj)
            return copy.deepcopy(obj)

    def update(
        self,
        t: ResourceType,
        ns: str,
        name: str,
        change: Callable[[Obj], Obj],
        *,
        subresource: str = "",
        want_rv: str | None = None,
    ) -> Obj:
        """Apply ``change`` to the current object; ``want_rv`` (or the resourceVersion
        the changed object carries) must be the current one, else 409."""
        with self._cond:
            key = self._key(t, ns, name)
            cur = self._objects.get(key)
            if cur is None:
                raise ApiError(404, "NotFound", f'{t.plural} "{name}" not found')
            if self._conflicts.get(t.plural, 0) > 0 and subresource != "status":
                self._conflicts[t.plural] -= 1
                self.stats.conflicts += 1
                self.stats.injected_conflicts += 1
                # Someone else wrote: the object's resourceVersion moves on.
                other = self._conflict_changes.pop(t.plural, None)
                if other is not None:
                    cur = other(copy.deepcopy(cur))
                    self._objects[key] = cur
                self._rv += 1
                cur["metadata"]["resourceVersion"] = str(self._rv)
                self._record("MODIFIED", t, cur)
                raise self._conflict(t, name)
            new = change(copy.deepcopy(cur))
            rv = want_rv if want_rv is not None else new.get("metadata", {}).get("resourceVersion")
            if rv and rv != cur["metadata"]["resourceVersion"]:
                self.stats.conflicts += 1
                raise self._conflict(t, name)
            meta = new.setdefault("metadata", {})
            # What the server owns cannot be changed by a client.
            for k in ("uid", "creationTimestamp", "deletionTimestamp", "namespace", "name"):
                if k in cur["metadata"]:
                    meta[k] = cur["metadata"][k]
                else:
                    meta.pop(k, None)
            if subresource == "status":
                new = {**cur, "status": new.get("status", {})}
                new["metadata"] = copy.deepcopy(cur["metadata"])
            elif t.status_subresource:
                # The main resource ignores status changes (as with the status subresource).
                if "status" in cur:
                    new["status"] = copy.deepcopy(cur["status"])
                else:
                    new.pop("status", None)
            meta = new["metadata"]
            meta["generation"] = cur["metadata"].get("generation", 1) + (
                1 if new.get("spec") != cur.get("spec") else 0
            )
            meta["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self._stamp(t, new)
            if new == cur:
                return copy.deepcopy(cur)  # no change: no new resourceVersion, no event
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._stamp(t, new)
            if cur["metadata"].get("deletionTimestamp") and not meta.get("finalizers"):
                del self._objects[key]
                self._record("DELETED", t, new)
                return copy.deepcopy(new)
            self._objects[key] = new
            if t.kind == "CustomResourceDefinition":
                self._crd_changed(new, deleted=False)
            self._record("MODIFIED", t, new)
            return copy.deepcopy(new)

    def _conflict(self, t: ResourceType, name: str) -> ApiError:
        what = f"{t.plural}.{t.group}" if t.group else t.plural
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {what} "{name}": the object has been'
            " modified; please apply your changes to the latest version and try again",
        )

    def patch(
        self,
        t: ResourceType,
        ns: str,
        name: str,
        body: Any,
        content_type: str,
        subresource: str = "",
    ) -> Obj:
        ct = content_type.split(";")[0].strip()
        if ct in ("application/merge-patch+json", "application/strategic-merge-patch+json") and (
            not isinstance(body, dict)
        ):
            raise ApiError(400, "BadRequest", f"{ct}: the patch must be a JSON object")
        if ct == "application/merge-patch+json":
            fn: Callable[[Obj], Obj] = lambda cur: merge_patch(cur, body)  # noqa: E731
        elif ct == "application/strategic-merge-patch+json":
            if t.group not in ("", "autoscaling", "coordination.k8s.io"):
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "strategic merge patch is not supported for custom resources",
                )
            fn = lambda cur: strategic_merge_patch(cur, body)  # noqa: E731
        elif ct == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "BadRequest", "json patch: expected a list of operations")
            fn = lambda cur: json_patch(cur, body)  # noqa: E731
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format: {ct}",
            )
        return self.update(t, ns, name, fn, subresource=subresource)

    def delete(
        self, t: ResourceType, ns: str, name: str, grace_s: int | None = None, uid: str = ""
    ) -> Obj:
        """``uid``: the DeleteOptions' precondition (a 409 when the object of that name
        is another one now, e.g. a pod an operator recreated)."""
        with self._cond:
            key = self._key(t, ns, name)
            cur = self._objects.get(key)
            if cur is None:
                raise ApiError(404, "NotFound", f'{t.plural} "{name}" not found')
            meta = cur["metadata"]
            if uid and meta.get("uid") != uid:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: UID in precondition: {uid},"
                    f" UID in object meta: {meta.get('uid')}",
                )
            graceful = (
                t.kind == "Pod"
                and cur.get("spec", {}).get("nodeName")
                and (grace_s is None or grace_s > 0)
                and cur.get("status", {}).get("phase") not in ("Succeeded", "Failed")
            )
            if (graceful or meta.get("finalizers")) and not meta.get("deletionTimestamp"):
                self._rv += 1
                meta["deletionTimestamp"] = now_rfc3339()
                meta["deletionGracePeriodSeconds"] = (
                    grace_s
                    if grace_s is not None
                    else cur.get("spec", {}).get("terminationGracePeriodSeconds", 30)
                )
                meta["resourceVersion"] = str(self._rv)
                self._record("MODIFIED", t, cur)
                return copy.deepcopy(cur)
            if meta.get("deletionTimestamp") and meta.get("finalizers"):
                return copy.deepcopy(cur)
            del self._objects[key]
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._record("DELETED", t, cur)
            if t.kind == "CustomResourceDefinition":
                self._crd_changed(cur, deleted=True)
            if t.kind == "Namespace":
                for k in [k for k in self._objects if k[2] == name and k[1] != "namespaces"]:
                    gone = self._objects.pop(k)
                    self._rv += 1
                    gone["metadata"]["resourceVersion"] = str(self._rv)
                    self._record(
                        "DELETED", self.type_of_kind(gone["apiVersion"], gone["kind"]), gone
                    )
            return copy.deepcopy(cur)


def _ns(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
