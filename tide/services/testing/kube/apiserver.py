"""A Kubernetes API server emulator over real HTTP (stdlib ThreadingHTTPServer).

Why not a library: kmock (tried for the agent's node watch) serves lists and
watches without resourceVersion semantics, 410 Gone or timeoutSeconds, and the
``kubernetes`` package ships no server. The semantics here are the ones Tide
depends on, each as the real API server has it:

- every object has ``metadata.resourceVersion`` from one cluster-wide counter
  (etcd's revision); an update or a patch carrying a stale one is a 409
  Conflict, one without it applies to the latest;
- watches (``?watch=true``) from a resourceVersion replay the changes after it
  from a bounded history, then follow new ones until ``timeoutSeconds``; a
  resourceVersion older than the history gets an ERROR event with a 410 Status
  (``compact()`` forces it); without one, the current objects come first as
  ADDED;
- merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch
  (treated as a merge patch, with lists of named items merged by name: enough
  for what kubectl sends for pods, nodes and the others here);
- label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors
  (dotted paths, = and !=) on lists and watches;
- CRDs: a created CustomResourceDefinition serves its resources under
  ``/apis/GROUP/VERSION`` at once, with the ``status`` subresource when
  declared, ``metadata.generation`` bumped on spec changes;
- graceful pod deletion: a pod bound to a node gets ``deletionTimestamp`` and
  stays until its kubelet deletes it again with grace 0 (``kubelet.py``);
  objects with finalizers stay until they are removed;
- discovery (/api, /apis, each group version's resource list), /version, and
  an empty OpenAPI v3 index so that kubectl validates on the server side.

Faults for tests: :meth:`KubeApiServer.conflict_next` answers the next
updates of a resource with 409 as if someone wrote in between;
:meth:`compact` and :meth:`drop_watches`; :meth:`all_at_once` makes changes a watch
never saw before a compaction; :meth:`hang_watches` stalls new watches.

Where each part lives: the types in ``resources.py``, the objects and their writes
in ``store.py``, the watches and their faults in ``watch.py``, selectors and patches
in ``semantics.py``, the HTTP edge in ``wire.py``; this module puts them behind a
server and keeps the names the tests and stand-ins import.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from tide.services.testing.kube.auth import TokenAuthority
from tide.services.testing.kube.resources import BUILTINS, ResourceType
from tide.services.testing.kube.store import Stats, now_rfc3339
from tide.services.testing.kube.watch import WatchableStore
from tide.services.testing.kube.wire import handler

__all__ = ["BUILTINS", "KubeApiServer", "ResourceType", "Stats", "now_rfc3339"]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up mid-response (a watch closed, a TLS session cut) is
        # routine for an API server: not a traceback on stderr.
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class KubeApiServer(WatchableStore):
    """The emulator: ``start()``, then point a kubeconfig (``write_kubeconfig``) or a
    client Configuration (``host``) at it; ``close()`` when done."""

    def __init__(
        self,
        *,
        history: int = 1000,
        port: int = 0,
        tls: tuple[str, str, str] | None = None,
        require_auth: bool = False,
    ) -> None:
        """``tls``: (certificate, key, CA) files to serve HTTPS, as a cluster's API server
        does (the certificate names 127.0.0.1: what KUBERNETES_SERVICE_HOST points at).
        ``require_auth``: every request needs a bearer token (401 otherwise): a pod's
        ServiceAccount token or ``tokens.admin_token``."""
        super().__init__(history=history)
        self.tokens = TokenAuthority()
        self.require_auth = require_auth
        self.ca_file = tls[2] if tls else ""
        self._server = _Server(("127.0.0.1", port), handler(self))
        self._server.daemon_threads = True
        if tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(tls[0], tls[1])
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def host(self) -> str:
        scheme = "https" if self.ca_file else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self) -> KubeApiServer:
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        cluster: dict[str, str] = {"server": self.host}
        if self.ca_file:
            cluster["certificate-authority"] = self.ca_file
        user = {"token": self.tokens.admin_token} if self.require_auth else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": cluster}],
            "users": [{"name": "tester", "user": user}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
        return path

    def wait_closing(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closing, timeout=timeout_s)

    @property
    def closing(self) -> bool:
        return self._closing
