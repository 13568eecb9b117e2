"""Edge validation of every request, driven by the proto descriptors: one walk over the
fields a message has set, with the rules below, so a new field is checked the day it
is added. The guard (tide.services.common.guard) runs it before any servicer, and a bad
field is INVALID_ARGUMENT naming it (``gpus[2].utilization_pct: must be finite``).

- float and double: finite; not negative, except the fields in :data:`SIGNED`
- signed integers: not negative (ids and counts), except :data:`SIGNED`
- enums: a value the proto names
- google.protobuf.Timestamp: within 0001-01-01..9999-12-31 with nanos in 0..999,999,999
  (what the well-known type allows; anything else made handlers fail with INTERNAL)
- strings: at most :data:`MAX_STRING_CHARS`; ids (``job_id``, ``node_name``,
  ``pod_name``, ``member_id``...) at most 253 characters of their form
- repeated fields: at most :data:`MAX_LIST_ITEMS` items

What a field means (a job's bounds, a report's age) is the domain's to check.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.internal import api_implementation
from google.protobuf.timestamp_pb2 import Timestamp

from tide.base.errors import InvalidArgument

MAX_STRING_CHARS = 4096
MAX_LIST_ITEMS = 4096
MAX_ID_CHARS = 253
#: Timestamp.seconds of 0001-01-01T00:00:00Z and of 9999-12-31T23:59:59Z.
MIN_TIMESTAMP_S = -62135596800
MAX_TIMESTAMP_S = 253402300799

#: Numeric fields where a negative value means something.
SIGNED = frozenset({"tide.v1.GpuSample.temperature_c"})

_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?"
#: Id fields and their form (a Kubernetes name; a job is NAMESPACE/NAME).
ID_FORMS: dict[str, re.Pattern[str]] = {
    "job_id": re.compile(rf"{_NAME}/{_NAME}"),
    "node_name": re.compile(_NAME),
    "pod_name": re.compile(_NAME),
    "member_id": re.compile(_NAME),
    "boot_id": re.compile(r"[A-Za-z0-9._-]{1,128}"),
    "launcher_id": re.compile(r"[A-Za-z0-9._-]{1,128}"),
    "pod_uid": re.compile(r"[A-Za-z0-9._-]{1,128}"),
}

_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)
_SIGNED_INTS = (
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_SFIXED32,
    FieldDescriptor.TYPE_SFIXED64,
)

Check = Callable[[str, Any], None]
_TS = "google.protobuf.Timestamp"


def _bad(path: str, why: str, value: Any) -> InvalidArgument:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return InvalidArgument(f"{path}: {why}, got {shown}")


def _float(signed: bool) -> Check:
    def check(path: str, v: float) -> None:
        if not math.isfinite(v):
            raise _bad(path, "must be finite", v)
        if v < 0 and not signed:
            raise _bad(path, "must be >= 0", v)

    return check


def _int(path: str, v: int) -> None:
    if v < 0:
        raise _bad(path, "must be >= 0", v)


def _enum(field: FieldDescriptor) -> Check:
    assert field.enum_type is not None
    numbers = frozenset(field.enum_type.values_by_number)
    name = field.enum_type.name

    def check(path: str, v: int) -> None:
        if v not in numbers:
            raise _bad(path, f"not a value of {name}", v)

    return check


def _string(name: str) -> Check:
    form = ID_FORMS.get(name)

    def check(path: str, v: str) -> None:
        if form is not None:
            if len(v) > MAX_ID_CHARS or not form.fullmatch(v):
                raise _bad(path, f"not a valid {name}", v)
        elif len(v) > MAX_STRING_CHARS:
            raise _bad(path, f"longer than {MAX_STRING_CHARS} characters", f"{len(v)} characters")

    return check


def _bytes(path: str, v: bytes) -> None:
    if len(v) > MAX_STRING_CHARS:
        raise _bad(path, f"longer than {MAX_STRING_CHARS} bytes", f"{len(v)} bytes")


def _timestamp(path: str, ts: Any) -> None:
    if not MIN_TIMESTAMP_S <= ts.seconds <= MAX_TIMESTAMP_S:
        raise _bad(path + ".seconds", "outside 0001-01-01..9999-12-31", ts.seconds)
    if not 0 <= ts.nanos < 1_000_000_000:
        raise _bad(path + ".nanos", "must be in 0..999999999", ts.nanos)


def _scalar_check(field: FieldDescriptor) -> Check | None:
    full = field.full_name
    if field.type in _FLOATS:
        return _float(full in SIGNED)
    if field.type in _SIGNED_INTS:
        return None if full in SIGNED else _int
    if field.type == FieldDescriptor.TYPE_ENUM:
        return _enum(field)
    if field.type == FieldDescriptor.TYPE_STRING:
        return _string(field.name)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _bytes
    return None


# Per message type: (field number → (name, repeated, message?, scalar check)).
_Plan = dict[int, tuple[str, bool, bool, Check | None]]
# By descriptor, not full name: two pools may each hold a type of one name with other fields.
_PLANS: dict[Descriptor, _Plan] = {}


def _plan(desc: Descriptor) -> _Plan:
    plan = _PLANS.get(desc)
    if plan is None:
        plan = {}
        for f in desc.fields:
            is_msg = f.type == FieldDescriptor.TYPE_MESSAGE
            repeated = f.is_repeated
            check: Check | None
            if is_msg and f.message_type is not None and f.message_type.full_name == _TS:
                check, is_msg = _timestamp, False
            elif is_msg:
                check = None
            else:
                check = _scalar_check(f)
            plan[f.number] = (f.name, repeated, is_msg, check)
        _PLANS[desc] = plan
    return plan


def validate_message(msg: Any, prefix: str = "") -> None:
    """InvalidArgument naming the first bad field of ``msg`` (and its sub-messages)."""
    # The compiled check first: it builds no path and no list of fields, and says
    # True only where the walk would find nothing; the walk names what is wrong.
    check = _BY_TYPE.get(type(msg))
    if check is None:
        check = _BY_TYPE[type(msg)] = _compiled(msg.DESCRIPTOR)
    if check(msg):
        return
    _walk(msg, prefix)


def _walk(msg: Any, prefix: str = "") -> None:
    plan = _plan(msg.DESCRIPTOR)
    for field, value in msg.ListFields():
        name, repeated, is_msg, check = plan[field.number]
        path = prefix + name
        if repeated:
            if len(value) > MAX_LIST_ITEMS:
                raise _bad(path, f"more than {MAX_LIST_ITEMS} items", f"{len(value)} items")
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                for k in value:
                    v = value[k]
                    if is_msg:
                        _walk(v, f"{path}[{k!r}].")
                continue
            for i, item in enumerate(value):
                if is_msg:
                    _walk(item, f"{path}[{i}].")
                elif check is not None:
                    check(f"{path}[{i}]", item)
        elif is_msg:
            _walk(value, path + ".")
        elif check is not None:
            check(path, value)


#: Per message type, its compiled check (:func:`_compile`), by descriptor and by class: not
#: by full name, which a second type of that name with more fields (another pool) shares.
_COMPILED: dict[Descriptor, Callable[[Any], bool]] = {}
_BY_TYPE: dict[type, Callable[[Any], bool]] = {}
# Unbound under upb, where every message's HasField is the one method of its Message: no
# bound method built per call. The pure-Python backend (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION
# =python) gives each class its own HasField, so Timestamp's would refuse every other type.
_HAS_FIELD: Callable[[Any, str], bool] = (
    Timestamp.HasField if api_implementation.Type() == "upb" else lambda m, name: m.HasField(name)
)
#: Per id form, values that passed it: a node's name and boot id come with every report,
#: and a set look-up costs less than the regular expression. Emptied when full.
_PASSED_IDS_MAX = 4096


def _compiled(desc: Descriptor) -> Callable[[Any], bool]:
    check = _COMPILED.get(desc)
    if check is None:
        check = _COMPILED[desc] = _compile(desc)
    return check


def _id_passes(passed: set[str], form: re.Pattern[str], v: str) -> bool:
    if len(v) > MAX_ID_CHARS or not form.fullmatch(v):
        return False
    if len(passed) >= _PASSED_IDS_MAX:
        passed.clear()
    passed.add(v)
    return True


def _condition(field: FieldDescriptor, x: str, env: dict[str, Any]) -> str | None:
    """A Python expression, true when the value ``x`` of ``field`` keeps the rules of
    :func:`_scalar_check` (None: the field has no rule)."""
    if field.type in _FLOATS:
        # NaN fails every comparison.
        if field.full_name in SIGNED:
            return f"-_INF < {x} < _INF"
        return f"0.0 <= {x} < _INF"
    if field.type in _SIGNED_INTS:
        return None if field.full_name in SIGNED else f"{x} >= 0"
    k = len(env)
    if field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        env[f"E{k}"] = frozenset(field.enum_type.values_by_number)
        return f"{x} in E{k}"
    if field.type == FieldDescriptor.TYPE_STRING:
        form = ID_FORMS.get(field.name)
        if form is None:
            return f"len({x}) <= {MAX_STRING_CHARS}"
        env[f"P{k}"], env[f"F{k}"] = set(), form
        return f"({x} in P{k} or _id_passes(P{k}, F{k}, {x}))"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return f"len({x}) <= {MAX_STRING_CHARS}"
    return None


_TS_OK = (
    f"{MIN_TIMESTAMP_S} <= {{x}}.seconds <= {MAX_TIMESTAMP_S} and 0 <= {{x}}.nanos < 1000000000"
)


def _emit(
    desc: Descriptor, m: str, env: dict[str, Any], out: list[str], pad: str, depth: int
) -> None:
    """Append the lines that check the message in variable ``m`` (see :func:`_compile`).
    A sub-message's fields are checked inline; a type nested deeper than a few levels
    (a recursive one) is checked by its own compiled function."""
    n = depth + 1
    for f in desc.fields:
        name = f.name
        if name.isidentifier() and not keyword.iskeyword(name):
            read = f"{m}.{name}"
        else:
            read = f"getattr({m}, {name!r})"
        sub = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if f.is_repeated:
            if sub is not None and sub.GetOptions().map_entry:
                out.append(f"{pad}if len({read}): return False")
                continue
            v, x = f"v{n}", f"x{n}"
            out.append(f"{pad}{v} = {read}")
            out.append(f"{pad}if len({v}) > {MAX_LIST_ITEMS}: return False")
            if sub is not None and sub.full_name == _TS:
                out.append(f"{pad}for {x} in {v}:")
                out.append(f"{pad}    if not ({_TS_OK.format(x=x)}): return False")
            elif sub is not None and depth < _INLINE_DEPTH:
                out.append(f"{pad}for {x} in {v}:")
                out.append(f"{pad}    pass")
                _emit(sub, x, env, out, pad + "    ", n)
            elif sub is not None:
                k = len(env)
                env[f"D{k}"] = sub
                out.append(f"{pad}s{n} = _compiled(D{k})")
                out.append(f"{pad}for {x} in {v}:")
                out.append(f"{pad}    if not s{n}({x}): return False")
            else:
                cond = _condition(f, x, env)
                if cond is not None:
                    out.append(f"{pad}for {x} in {v}:")
                    out.append(f"{pad}    if not ({cond}): return False")
            continue
        if sub is not None:
            # An unset message reads as its empty default, which passes (an unset
            # Timestamp reads 0, within the range).
            x = f"m{n}"
            if sub.full_name == _TS:
                out.append(f"{pad}{x} = {read}")
                out.append(f"{pad}if not ({_TS_OK.format(x=x)}): return False")
            elif depth < _INLINE_DEPTH:
                out.append(f"{pad}{x} = {read}")
                _emit(sub, x, env, out, pad, n)
            else:
                # Only a set one: a recursive type (Node { Node child }) would check
                # the unset default's default's... without end (a message field always
                # has presence).
                k = len(env)
                env[f"D{k}"] = sub
                out.append(f"{pad}if _has({m}, {name!r}) and not _compiled(D{k})({read}):")
                out.append(f"{pad}    return False")
            continue
        cond = _condition(f, "x", env)
        if cond is None:
            continue
        default_passes = eval(cond, dict(env), {"x": f.default_value})
        if not f.has_presence:
            # Unset reads the default, which ListFields leaves out: a default that
            # breaks the rule ("" for an id) is not checked.
            out.append(f"{pad}x = {read}")
            out.append(f"{pad}if {'' if default_passes else 'x and '}not ({cond}): return False")
        elif default_passes:
            out.append(f"{pad}x = {read}")
            out.append(f"{pad}if not ({cond}) and _has({m}, {name!r}): return False")
        else:
            # An unset field reads a default that breaks the rule (GpuSample's GPM
            # fields read NaN): presence first.
            out.append(f"{pad}if _has({m}, {name!r}):")
            out.append(f"{pad}    x = {read}")
            out.append(f"{pad}    if not ({cond}): return False")


#: How deep sub-messages are checked inline (NodeReport, its GpuSample, their PodRef).
_INLINE_DEPTH = 3


def _compile(desc: Descriptor) -> Callable[[Any], bool]:
    """A function of one message of ``desc``'s type: True when no field it has set
    breaks a rule (``_walk`` would find nothing), False when one may (``_walk`` then
    names it). Generated as Python source, a read or two per field, as dataclasses
    generates ``__init__``: the walk's list of fields and its path per field cost
    every report of the agents several times what the ingest does (docs/scaler.md
    "Ingest ceiling again")."""
    env: dict[str, Any] = {
        "_compiled": _compiled,
        "_id_passes": _id_passes,
        "_INF": math.inf,
        "_has": _HAS_FIELD,
    }
    body: list[str] = []
    _emit(desc, "m", env, body, "    ", 0)
    source = "def check(m):\n" + "".join(f"{line}\n" for line in body) + "    return True\n"
    exec(compile(source, f"<validate {desc.full_name}>", "exec"), env)
    check: Callable[[Any], bool] = env["check"]
    return check


def validate_request(request: Any, method: str = "") -> None:
    """The guard's hook: every request (and every message of a request stream)."""
    validate_message(request)
