"""A small Kubernetes API emulator for Nodes, over real HTTP.

kmock (an off-the-shelf emulator, tried and dropped) serves lists and watches, but has no
resourceVersion semantics, no 410 Gone and no timeoutSeconds, which are the
parts of the watch protocol the agent must get right. This one speaks them:

- GET /api/v1/nodes[?fieldSelector=metadata.name=X]: a NodeList with the
  current resourceVersion;
- the same with watch=true&resourceVersion=R&timeoutSeconds=T: the events
  after R, then new ones as they happen, until T passes; an ERROR event with
  code 410 when R is older than what ``compact()`` kept;
- ``blackhole = True`` makes new watches send headers and then nothing, for
  ever (a dead path the client must time out).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


class NodeApi:
    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.rv = 1
        self.node: dict[str, Any] | None = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node_name, "resourceVersion": "1", "uid": "uid-1"},
            "spec": {},
        }
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_rv = 0
        self.blackhole = False
        self.lists = 0
        self.watches = 0
        self._cond = threading.Condition()
        self._generation = 0  # bumped by drop_watches()
        self._closing = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def _change(self, kind: str, node: dict[str, Any] | None) -> None:
        with self._cond:
            self.rv += 1
            if node is not None:
                node["metadata"]["resourceVersion"] = str(self.rv)
                self.history.append((self.rv, kind, copy.deepcopy(node)))
            self.node = node
            self._cond.notify_all()

    def update_spec(self, **spec: Any) -> None:
        """Replace spec fields, e.g. unschedulable=True, taints=[...]."""
        assert self.node is not None
        node = copy.deepcopy(self.node)
        node["spec"].update(spec)
        self._change("MODIFIED", node)

    def delete(self) -> None:
        assert self.node is not None
        node = copy.deepcopy(self.node)
        with self._cond:
            self.rv += 1
            node["metadata"]["resourceVersion"] = str(self.rv)
            self.history.append((self.rv, "DELETED", node))
            self.node = None
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget history: watches from any older resourceVersion now get 410."""
        with self._cond:
            self.oldest_rv = self.rv
            self.history.clear()

    def drop_watches(self) -> None:
        """End every open watch, as an API server restart or a load balancer would."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            # Chunked watch responses, as the real API server sends: a client reads
            # each event as its chunk arrives, not when the connection closes.
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if url.path != "/api/v1/nodes":
                    self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                selector = query.get("fieldSelector", "")
                if selector and selector != f"metadata.name={api.node_name}":
                    self._json(400, {"kind": "Status", "code": 400, "message": selector})
                    return
                if query.get("watch") in ("true", "1"):
                    self._watch(query)
                else:
                    self._list()

            def _list(self) -> None:
                with api._cond:
                    api.lists += 1
                    items = [copy.deepcopy(api.node)] if api.node is not None else []
                    rv = api.rv
                self._json(
                    200,
                    {
                        "apiVersion": "v1",
                        "kind": "NodeList",
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    },
                )

            def _send_event(self, kind: str, obj: dict[str, Any]) -> None:
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()

            def _end(self) -> None:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _watch(self, query: dict[str, str]) -> None:
                since = int(query.get("resourceVersion") or 0)
                timeout_s = float(query.get("timeoutSeconds") or 1800)
                deadline = time.monotonic() + timeout_s
                with api._cond:
                    api.watches += 1
                    blackhole = api.blackhole
                    generation = api._generation
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.flush()
                if blackhole:
                    with api._cond:
                        api._cond.wait_for(lambda: api._closing, timeout=60)
                    return
                if since < api.oldest_rv:
                    status = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {since} ({api.oldest_rv})",
                        "reason": "Expired",
                        "code": 410,
                    }
                    self._send_event("ERROR", status)
                    self._end()
                    return
                sent = since
                try:
                    while True:
                        with api._cond:
                            api._cond.wait_for(
                                lambda sent=sent: (
                                    api._closing
                                    or api._generation != generation
                                    or any(rv > sent for rv, _, _ in api.history)
                                ),
                                timeout=max(0.0, deadline - time.monotonic()),
                            )
                            if api._closing or api._generation != generation:
                                self._end()
                                return
                            fresh = [(rv, k, o) for rv, k, o in api.history if rv > sent]
                        for rv, kind, obj in fresh:
                            self._send_event(kind, obj)
                            sent = rv
                        if time.monotonic() >= deadline:
                            self._end()
                            return
                except (BrokenPipeError, ConnectionResetError):
                    return

        return Handler
