"""The HTTP edge of the API server emulator: URL routing, discovery, the OpenAPI v3
index kubectl reads, JSON bodies, chunked watch streams."""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from tide.services.testing.kube.semantics import ApiError, Obj

if TYPE_CHECKING:
    from tide.services.testing.kube.apiserver import KubeApiServer, ResourceType

_PATH = re.compile(
    r"^/(?:api/(?P<cv>v1)|apis/(?P<g>[^/]+)/(?P<v>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def _openapi_v3(types: list[ResourceType], gv_path: str) -> Obj:
    """A group version's OpenAPI v3 document with no schemas, only each object path's
    PATCH with its ``fieldValidation`` parameter: kubectl reads that to decide that
    the server validates fields itself (and then needs no schema of its own)."""
    paths: dict[str, Obj] = {}
    for t in types:
        if t.api_prefix[1:] != gv_path:
            continue
        gvk = {"group": t.group, "version": t.version, "kind": t.kind}
        scope = "/namespaces/{namespace}" if t.namespaced else ""
        op = {
            "x-kubernetes-group-version-kind": gvk,
            "x-kubernetes-action": "patch",
            "parameters": [
                {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
                {"name": "dryRun", "in": "query", "schema": {"type": "string"}},
            ],
            "responses": {"200": {"description": "OK"}},
        }
        paths[f"{t.api_prefix}{scope}/{t.plural}/{{name}}"] = {"patch": op}
        post = {**op, "x-kubernetes-action": "post"}
        paths[f"{t.api_prefix}{scope}/{t.plural}"] = {"post": post}
    if not paths:
        raise ApiError(404, "NotFound", f"no OpenAPI document for {gv_path}")
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.35.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }


def _list_kind(t: ResourceType) -> str:
    return f"{t.kind}List"


def handler(api: KubeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Chunked watch responses, as the real API server sends them.
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        # -- plumbing --

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return None
            try:
                return json.loads(raw)
            except ValueError:
                raise ApiError(400, "BadRequest", "the request body is not JSON") from None

        def _serve(self, verb: str) -> None:
            api.stats.requests[verb] += 1
            try:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                path = url.path.rstrip("/") or "/"
                self._authenticate()
                if verb == "GET" and self._discovery(path):
                    return
                if verb == "POST" and path == "/apis/authentication.k8s.io/v1/tokenreviews":
                    self._send(201, api.tokens.review(self._body() or {}))
                    return
                m = _PATH.match(path)
                if not m:
                    raise ApiError(
                        404, "NotFound", f"the server could not find the requested resource {path}"
                    )
                self._resource(verb, m.groupdict(), query)
            except ApiError as exc:
                self._send(exc.code, exc.status())
            except (BrokenPipeError, ConnectionResetError):
                return

        def _authenticate(self) -> None:
            if not api.require_auth:
                return
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not api.tokens.authenticates(token.strip()):
                raise ApiError(401, "Unauthorized", "Unauthorized")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        # -- discovery --

        def _discovery(self, path: str) -> bool:
            types = api.types()
            if path == "/version":
                self._send(
                    200,
                    {
                        "major": "1",
                        "minor": "35",
                        "gitVersion": "v1.35.0-tide-emulator",
                        "platform": "linux/amd64",
                    },
                )
            elif path == "/api":
                self._send(
                    200,
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [
                            {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{api.port}"}
                        ],
                    },
                )
            elif path == "/apis":
                groups: dict[str, list[str]] = {}
                for t in types:
                    if t.group and t.version not in groups.setdefault(t.group, []):
                        groups[t.group].append(t.version)
                self._send(
                    200,
                    {
                        "kind": "APIGroupList",
                        "apiVersion": "v1",
                        "groups": [
                            {
                                "name": g,
                                "versions": [
                                    {"groupVersion": f"{g}/{v}", "version": v} for v in vs
                                ],
                                "preferredVersion": {
                                    "groupVersion": f"{g}/{vs[0]}",
                                    "version": vs[0],
                                },
                            }
                            for g, vs in sorted(groups.items())
                        ],
                    },
                )
            elif path == "/openapi/v3":
                gvs = sorted({t.api_prefix[1:] for t in types})
                self._send(
                    200, {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}"} for gv in gvs}}
                )
            elif path.startswith("/openapi/v3/"):
                self._send(200, _openapi_v3(types, path[len("/openapi/v3/") :]))
            elif path == "/api/v1" or re.fullmatch(r"/apis/[^/]+/[^/]+", path):
                gv = "v1" if path == "/api/v1" else path[len("/apis/") :]
                resources = []
                for t in types:
                    if t.group_version != gv:
                        continue
                    resources.append(
                        {
                            "name": t.plural,
                            "singularName": t.singular or t.kind.lower(),
                            "namespaced": t.namespaced,
                            "kind": t.kind,
                            "verbs": [
                                "create",
                                "delete",
                                "get",
                                "list",
                                "patch",
                                "update",
                                "watch",
                            ],
                            "shortNames": list(t.short_names),
                        }
                    )
                    if t.status_subresource:
                        resources.append(
                            {
                                "name": f"{t.plural}/status",
                                "singularName": "",
                                "namespaced": t.namespaced,
                                "kind": t.kind,
                                "verbs": ["get", "patch", "update"],
                            }
                        )
                if not resources:
                    raise ApiError(404, "NotFound", f"no group version {gv}")
                self._send(
                    200,
                    {
                        "kind": "APIResourceList",
                        "apiVersion": "v1",
                        "groupVersion": gv,
                        "resources": resources,
                    },
                )
            elif re.fullmatch(r"/apis/[^/]+", path):
                g = path[len("/apis/") :]
                vs = [t.version for t in types if t.group == g]
                if not vs:
                    raise ApiError(404, "NotFound", f"no group {g}")
                vs = list(dict.fromkeys(vs))
                self._send(
                    200,
                    {
                        "kind": "APIGroup",
                        "apiVersion": "v1",
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    },
                )
            else:
                return False
            return True

        # -- resources --

        def _resource(self, verb: str, m: dict[str, str | None], query: dict[str, str]) -> None:
            group = m["g"] or ""
            version = m["cv"] or m["v"] or ""
            ns, plural, name, sub = m["ns"] or "", m["plural"] or "", m["name"], m["sub"] or ""
            t = api.rtype(group, version, plural)
            if not t.namespaced and m["ns"] is not None:
                # /api/v1/namespaces/X/status etc.: the regex read "namespaces" as a scope.
                raise ApiError(404, "NotFound", f"{plural} is not namespaced")
            if sub and sub != "status":
                raise ApiError(404, "NotFound", f"no subresource {sub}")
            if sub == "status" and not t.status_subresource:
                raise ApiError(404, "NotFound", f"{plural} has no status subresource")
            if verb == "GET":
                if name:
                    self._send(200, api.get(t, ns, name))
                elif query.get("watch") in ("true", "1"):
                    api.stats.watches += 1
                    self._watch(t, ns, query)
                else:
                    api.stats.lists += 1
                    items, rv = api.list(
                        t, ns, query.get("labelSelector", ""), query.get("fieldSelector", "")
                    )
                    self._send(
                        200,
                        {
                            "kind": _list_kind(t),
                            "apiVersion": t.group_version,
                            "metadata": {"resourceVersion": str(rv)},
                            "items": items,
                        },
                    )
            elif verb == "POST":
                if name:
                    raise ApiError(405, "MethodNotAllowed", "POST to a named object")
                body = self._body()
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "expected an object")
                self._check_kind(t, body)
                self._send(201, api.create(t, body, ns))
            elif verb == "PUT":
                body = self._body()
                if not name or not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "PUT needs a named object")
                self._check_kind(t, body)
                if not body.get("metadata", {}).get("resourceVersion"):
                    raise ApiError(
                        422,
                        "Invalid",
                        "metadata.resourceVersion: Invalid value: 0: must be specified for an update",
                    )
                self._send(200, api.update(t, ns, name, lambda cur: body, subresource=sub))
            elif verb == "PATCH":
                if not name:
                    raise ApiError(405, "MethodNotAllowed", "PATCH needs a named object")
                self._send(
                    200,
                    api.patch(t, ns, name, self._body(), self.headers.get("Content-Type", ""), sub),
                )
            elif verb == "DELETE":
                if not name:
                    raise ApiError(405, "MethodNotAllowed", "collection delete is not served")
                body = self._body() or {}
                grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
                uid = (body.get("preconditions") or {}).get("uid") or ""
                self._send(
                    200, api.delete(t, ns, name, int(grace) if grace is not None else None, uid)
                )

        def _check_kind(self, t: ResourceType, body: Obj) -> None:
            if body.get("kind") not in (None, t.kind) or body.get("apiVersion") not in (
                None,
                t.group_version,
            ):
                raise ApiError(
                    400,
                    "BadRequest",
                    f"expected {t.group_version} {t.kind}, got {body.get('apiVersion')} {body.get('kind')}",
                )

        def _watch(self, t: ResourceType, ns: str, query: dict[str, str]) -> None:
            events = api.watch(
                t,
                ns,
                query.get("resourceVersion", ""),
                query.get("labelSelector", ""),
                query.get("fieldSelector", ""),
                float(query.get("timeoutSeconds") or 1800),
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            if api.blackhole:
                api.wait_closing(60.0)
                return
            for kind, obj in events:
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler
