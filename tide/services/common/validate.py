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

import math
import re
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

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
_PLANS: dict[str, _Plan] = {}


def _plan(desc: Descriptor) -> _Plan:
    plan = _PLANS.get(desc.full_name)
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
        _PLANS[desc.full_name] = plan
    return plan


def validate_message(msg: Any, prefix: str = "") -> None:
    """InvalidArgument naming the first bad field of ``msg`` (and its sub-messages)."""
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
                        validate_message(v, f"{path}[{k!r}].")
                continue
            for i, item in enumerate(value):
                if is_msg:
                    validate_message(item, f"{path}[{i}].")
                elif check is not None:
                    check(f"{path}[{i}]", item)
        elif is_msg:
            validate_message(value, path + ".")
        elif check is not None:
            check(path, value)


def validate_request(request: Any, method: str = "") -> None:
    """The guard's hook: every request (and every message of a request stream)."""
    validate_message(request)
