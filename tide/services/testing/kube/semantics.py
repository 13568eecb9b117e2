"""The request semantics of the API server emulator that need no state: the error
shape (a Status), the three patch types, label and field selectors."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    """An API error as a Status object (code, reason, message)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


# --- patches --------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A merge patch in which lists of objects that all have a ``name`` (containers,
    env, ports, volumes, conditions by ``type``) merge item by item, as the
    strategic merge patch does for those fields; other lists replace."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = _merge_named_lists(out[k], v)
        else:
            out[k] = strategic_merge_patch(out.get(k), v)
    return out


def _merge_named_lists(old: list[Any], new: list[Any]) -> list[Any]:
    for key in ("name", "type"):
        if all(isinstance(i, dict) and key in i for i in [*old, *new]):
            merged = {i[key]: i for i in old}
            for item in new:
                merged[item[key]] = strategic_merge_patch(merged.get(item[key]), item)
            return list(merged.values())
    return copy.deepcopy(new)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"json patch: bad path {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Any, ops: list[Obj]) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(str(op.get("path", "")))
        try:
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise ApiError(422, "Invalid", f"json patch: test failed at {op['path']}")
                continue
            if kind in ("move", "copy"):
                src = _pointer(str(op["from"]))
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    doc = _remove(doc, src)
                doc = _add(doc, parts, value, replace=False)
            elif kind == "add":
                doc = _add(doc, parts, copy.deepcopy(op["value"]), replace=False)
            elif kind == "replace":
                _walk(doc, parts)  # must exist
                doc = _add(doc, parts, copy.deepcopy(op["value"]), replace=True)
            elif kind == "remove":
                doc = _remove(doc, parts)
            else:
                raise ApiError(422, "Invalid", f"json patch: unknown op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"json patch: {op}: {exc!r}") from None
    return doc


def _add(doc: Any, parts: list[str], value: Any, *, replace: bool) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif replace:
            parent[int(last)] = value
        else:
            parent.insert(int(last), value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KeyError(last)
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    parent = _walk(doc, parts[:-1])
    if isinstance(parent, list):
        del parent[int(parts[-1])]
    else:
        del parent[parts[-1]]
    return doc


# --- selectors ------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")


def _split_selector(sel: str) -> list[str]:
    """Split at commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in sel:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


@dataclass(frozen=True)
class _Requirement:
    """One term of a label selector: ``key`` against ``values`` with ``op``."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def __call__(self, labels: dict[str, str]) -> bool:
        v = labels.get(self.key)
        if self.op in ("=", "in"):
            return v in self.values
        if self.op in ("!=", "notin"):
            return v not in self.values
        return (self.key in labels) == (self.op == "exists")


def label_matcher(sel: str) -> Callable[[dict[str, str]], bool]:
    """A predicate over labels for a label selector string; ApiError 400 if malformed."""
    reqs: list[_Requirement] = []
    for raw in _split_selector(sel or ""):
        term = raw.strip()
        m = re.match(r"^([\w./-]+)\s*(==|!=|=)\s*([\w./-]*)$", term)
        if m:
            k, op, v = m.groups()
            reqs.append(_Requirement(k, "!=" if op == "!=" else "=", frozenset({v})))
            continue
        m = _SET_RE.match(term)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
        neg, k, op, values = m.groups()
        if op:
            vals = frozenset(x.strip() for x in values.split(",") if x.strip())
            reqs.append(_Requirement(k, op, vals))
        else:
            reqs.append(_Requirement(k, "!exists" if neg else "exists"))
    return lambda labels: all(r(labels) for r in reqs)


def field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for p in path.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_matcher(sel: str) -> Callable[[Obj], bool]:
    """A predicate over objects for a field selector (dotted paths, = == !=)."""
    terms: list[tuple[str, bool, str]] = []  # (path, equal, value)
    for term in _split_selector(sel or ""):
        m = re.match(r"^\s*([\w.]+)\s*(==|!=|=)\s*(.*?)\s*$", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, v = m.groups()
        terms.append((path, op != "!=", v))
    return lambda obj: all((field_value(obj, p) == v) == eq for p, eq, v in terms)
