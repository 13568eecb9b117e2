"""The official kubernetes client, configured, and a list-then-watch cache (a reflector).

Everything is plain JSON (dicts): lists are read raw and watch events are not
deserialized, so custom resources and core objects look alike and no typed
model can reject a field it does not know.

Every watch has a server-side ``timeout_seconds`` and a client-side
``_request_timeout`` a little longer (a dead connection would otherwise hang
the watch for ever, kubernetes-client/python#1402); a 410 Gone means the
resourceVersion was compacted away, so the reflector lists again; any other
failure re-lists after a jittered exponential backoff.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tide.base.errors import ConfigError
from tide.base.retry import Backoff

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

IN_CLUSTER = "in-cluster"


def api_client(source: str, what: str = "actuator kubernetes") -> client.ApiClient:
    """An ApiClient from ``in-cluster`` (the pod's ServiceAccount) or a kubeconfig path;
    ``what`` names the setting in the error if it cannot be loaded."""
    cfg = client.Configuration()
    try:
        if source == IN_CLUSTER:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=source, client_configuration=cfg
            )
    except (config.ConfigException, OSError) as exc:
        raise ConfigError(f"{what}:{source}: {exc}") from None
    # Several watches and the actuator's calls share the pool.
    cfg.connection_pool_maxsize = 16
    return client.ApiClient(cfg)


def raw(response: Any) -> Obj:
    """The JSON body of a call made with ``_preload_content=False``."""
    data: Obj = json.loads(response.data)
    return data


def key_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata", {})
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


@dataclass
class ReflectorStats:
    lists: int = 0
    watches: int = 0
    expired: int = 0  # 410 Gone answered to a watch: re-listed
    errors: int = 0
    not_served: int = 0  # lists answered 404


class Reflector:
    """Keeps ``objects`` (key -> JSON) equal to what a list call returns, by listing
    once and then watching from the list's resourceVersion, in a thread of its own.

    ``list_fn(*args, **kwargs)`` is a list method of the client (e.g.
    ``CoreV1Api.list_pod_for_all_namespaces``); ``on_change`` is called from that
    thread after every change (it must be thread-safe and quick)."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        *args: Any,
        on_change: Callable[[], None] | None = None,
        watch_timeout_s: int = 60,
        read_slack_s: float = 10.0,
        backoff: Backoff | None = None,
        **kwargs: Any,
    ) -> None:
        self.name = name
        self._list_fn = list_fn
        self._args = args
        self._kwargs = kwargs
        self._on_change = on_change or (lambda: None)
        self.watch_timeout_s = watch_timeout_s
        # How long past the server's own timeout a watch may stay silent before the
        # read gives up on it: the API server ends a healthy watch at timeout_seconds,
        # so a longer silence is a dead path or a stalled server.
        self.read_slack_s = read_slack_s
        self.not_served_relist_s = 30.0
        self._backoff = backoff or Backoff(0.2, 10.0)
        self._lock = threading.Lock()
        self._objects: dict[str, Obj] = {}
        self.synced = threading.Event()
        self.stats = ReflectorStats()
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name=f"reflector-{name}", daemon=True)

    def start(self) -> Reflector:
        self._thread.start()
        return self

    def stop(self, join_s: float = 1.0) -> None:
        """Ask the thread to end. A watch blocked in a read ends at its timeout or when
        the connection closes; the thread is a daemon, so nothing waits for it longer."""
        self._stop.set()
        resp = self._resp
        if resp is not None:
            # Unblocks the read: the thread sees the stop flag and ends.
            with contextlib.suppress(Exception):
                resp.shutdown() if hasattr(resp, "shutdown") else resp.close()
        self._thread.join(join_s)

    def objects(self) -> list[Obj]:
        with self._lock:
            return list(self._objects.values())

    def get(self, key: str) -> Obj | None:
        with self._lock:
            return self._objects.get(key)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self._list()
                self._backoff.reset()
                while not self._stop.is_set():
                    rv = self._watch_from(rv)
            except ApiException as exc:
                if exc.status == 410:
                    self.stats.expired += 1
                    logger.info(
                        "reflector %s: resourceVersion expired (410); listing again", self.name
                    )
                    continue
                if exc.status == 404:
                    self._not_served()
                    continue
                self._failed(exc)
            except Exception as exc:  # the connection, a decode error: list again later
                self._failed(exc)

    def _not_served(self) -> None:
        """The resource is not served (its CRD is not installed): an empty, synced cache,
        listed again now and then, so a CRD installed later is picked up."""
        if not self.stats.not_served:
            logger.info("reflector %s: not served by the API server (no CRD?); empty", self.name)
        self.stats.not_served += 1
        with self._lock:
            self._objects = {}
        self.synced.set()
        self._on_change()
        self._stop.wait(self.not_served_relist_s)

    def _failed(self, exc: Exception) -> None:
        self.stats.errors += 1
        delay = self._backoff.next_delay_s()
        logger.warning("reflector %s: %s; listing again in %.1f s", self.name, exc, delay)
        self._stop.wait(delay)

    def _list(self) -> str:
        body = raw(
            self._list_fn(*self._args, _preload_content=False, _request_timeout=30, **self._kwargs)
        )
        self.stats.lists += 1
        with self._lock:
            self._objects = {key_of(o): o for o in body.get("items") or []}
        self.synced.set()
        self._on_change()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    def _watch_from(self, rv: str) -> str:
        """One watch from ``rv`` until its timeout; the last resourceVersion seen.

        The list call itself with ``watch=True``, its lines read as they come:
        ``watch.Watch`` would deserialize into typed models (which reject what they
        do not know) and, without that, fails on ERROR events."""
        self.stats.watches += 1
        resp = self._list_fn(
            *self._args,
            watch=True,
            resource_version=rv,
            timeout_seconds=self.watch_timeout_s,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=self.watch_timeout_s + self.read_slack_s,
            **self._kwargs,
        )
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(
                        status=obj.get("code") or 500, reason=obj.get("message", "watch error")
                    )
                rv = str(obj.get("metadata", {}).get("resourceVersion", rv))
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED":
                        self._objects.pop(key_of(obj), None)
                    else:
                        self._objects[key_of(obj)] = obj
                self._on_change()
        finally:
            self._resp = None
            resp.close()
            resp.release_conn()
        return rv
