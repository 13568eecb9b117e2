"""Reliability catalog T24 for Kubernetes: every call Tide makes to the API server
with the official client carries ``_request_timeout``, and every watch a
server-side ``timeout_seconds`` beside it.

Without ``_request_timeout`` urllib3 waits on its socket for ever: an API server
behind a dead path (a partition, a stalled load balancer) hangs the calling
thread and whatever it holds, kubernetes-client/python#1402. A watch needs both:
``timeout_seconds`` ends a healthy watch so it is re-established, and the read
timeout gets it out of one whose connection died silently.

The check reads the source, like test_deadlines.py does for gRPC. A call is a
Kubernetes call when its method is one of the client's API methods (read from
the client's ``*Api`` classes) or when it passes one of the client's own
keywords (``_preload_content``, ``_request_timeout``): that is how a list
function handed around by reference (the Reflector's ``list_fn``) is called.
A watch is a call with ``watch=True`` or ``watch.Watch().stream(...)``. The
operators' stand-ins in tide/services/testing are test doubles, and exempt.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest
from kubernetes import client

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("tide",)
#: Test doubles: the API server emulator and the operators' stand-ins.
EXEMPT = ("tide/services/testing/",)
CLIENT_KEYWORDS = {"_preload_content", "_request_timeout"}


# Read when a test needs it, not at import: resolving the client's classes cost every
# pytest process (each xdist worker collects) 2-4 s of its collection.
@functools.cache
def api_methods() -> frozenset[str]:
    names: set[str] = set()
    # dir(), not vars(): the client's package resolves its classes lazily.
    for cls_name in dir(client):
        cls = getattr(client, cls_name)
        if not (cls_name.endswith("Api") and inspect.isclass(cls)) or cls is client.ApiClient:
            continue
        # An endpoint method has a ``_with_http_info`` twin; close() and the like do not.
        names |= {n[: -len("_with_http_info")] for n in vars(cls) if n.endswith("_with_http_info")}
    return frozenset(names)


def _is_watch(node: ast.Call) -> bool:
    for k in node.keywords:
        if k.arg == "watch" and not (isinstance(k.value, ast.Constant) and not k.value.value):
            return True
    # watch.Watch().stream(list_fn, ...)
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "stream"
        and isinstance(func.value, ast.Call)
        and ast.unparse(func.value.func).split(".")[-1] == "Watch"
    )


def kube_calls_without_timeout(source: str, path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        keywords = {k.arg for k in node.keywords}
        watch = _is_watch(node)
        if not (node.func.attr in api_methods() or keywords & CLIENT_KEYWORDS or watch):
            continue
        if None in keywords:
            # **kwargs may carry them; the function that builds them is checked where it is called.
            continue
        name = ast.unparse(node.func)
        if "_request_timeout" not in keywords:
            found.append(f"{path}:{node.lineno}: {name}(...) has no _request_timeout=")
        if watch and "timeout_seconds" not in keywords:
            found.append(f"{path}:{node.lineno}: watch {name}(...) has no timeout_seconds=")
    return found


def test_the_check_finds_calls_and_watches_without_timeouts() -> None:
    assert {"list_node", "patch_namespaced_custom_object", "create_token_review"} <= api_methods()
    bad = (
        "def f(core, custom, fn):\n"
        "    core.list_node()\n"
        "    custom.get_namespaced_custom_object('g', 'v', 'ns', 'p', 'n', _request_timeout=5)\n"
        "    self._list_fn(_preload_content=False)\n"
        "    core.list_node(watch=True, _request_timeout=70)\n"
        "    watch.Watch().stream(core.list_node, timeout_seconds=60)\n"
    )
    assert kube_calls_without_timeout(bad, "x.py") == [
        "x.py:2: core.list_node(...) has no _request_timeout=",
        "x.py:4: self._list_fn(...) has no _request_timeout=",
        "x.py:5: watch core.list_node(...) has no timeout_seconds=",
        "x.py:6: watch.Watch().stream(...) has no _request_timeout=",
    ]
    good = (
        "def f(core):\n"
        "    core.list_node(_request_timeout=(5, 15))\n"
        "    core.list_node(watch=True, timeout_seconds=60, _request_timeout=(5, 70))\n"
        "    Reflector('nodes', core.list_node)\n"  # a reference, called by the Reflector
        "    d.get(key)\n"
    )
    assert kube_calls_without_timeout(good, "x.py") == []


def test_every_kubernetes_call_in_production_code_has_a_timeout() -> None:
    problems: list[str] = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(EXEMPT) or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            problems += kube_calls_without_timeout(path.read_text(), rel)
    assert problems == [], "\n".join(problems)
