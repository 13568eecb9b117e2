"""The validator's compiled check against its walk: on every tide.v1 message type, with
fields set to values that keep and that break each rule, validate_message refuses
exactly what the walk refuses, naming the same field (the compiled check may only say
"nothing wrong" where the walk finds nothing)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tide.base.errors import InvalidArgument
from tide.services.common import validate
from tide.services.common.validate import _compiled, _walk, validate_message
from tide.v1 import (
    common_pb2,
    coordinator_pb2,
    peers_pb2,
    scaler_pb2,
    telemetry_pb2,
)

pytestmark = pytest.mark.unit

_MODULES = (common_pb2, coordinator_pb2, peers_pb2, scaler_pb2, telemetry_pb2)

_FLOATS = (0.0, -0.0, 1.5, 100.0, -1.0, math.nan, math.inf, -math.inf)
_INTS = (0, 1, 7, -1, -(2**31))
_STRINGS = ("", "a", "node-1", "ns/job", "a b", "x" * 254, "y" * 4097, "ok.name_1", "-bad")
_TIMESTAMPS = ((0, 0), (1_800_000_000, 5), (-62135596801, 0), (253402300800, 0), (5, -1))


def _types() -> list[Descriptor]:
    out: list[Descriptor] = []

    def add(d: Descriptor) -> None:
        if d.GetOptions().map_entry:
            return
        out.append(d)
        for n in d.nested_types:
            add(n)

    for mod in _MODULES:
        for d in mod.DESCRIPTOR.message_types_by_name.values():
            add(d)
    return out


def _scalar(f: FieldDescriptor, rng: random.Random) -> Any:
    t = f.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice(_FLOATS)
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.TYPE_STRING:
        return rng.choice(_STRINGS)
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.choice((b"", b"x", b"z" * 4097))
    if t == FieldDescriptor.TYPE_ENUM:
        assert f.enum_type is not None
        return rng.choice([*f.enum_type.values_by_number, 99])
    if t in (
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
    ):
        return rng.choice((0, 1, 9))
    return rng.choice(_INTS)


def _fill(msg: Any, rng: random.Random, bad: float, depth: int = 0) -> None:
    """Set a random subset of msg's fields; ``bad`` is how often a value may break a
    rule (else it is drawn from the values that keep them)."""
    for f in msg.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        sub = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if sub is not None and sub.GetOptions().map_entry:
            continue
        if sub is not None and sub.full_name == "google.protobuf.Timestamp":
            items = [getattr(msg, f.name).add() for _ in range(2)] if f.is_repeated else None
            for ts in items or [getattr(msg, f.name)]:
                s, n = rng.choice(_TIMESTAMPS if rng.random() < bad else _TIMESTAMPS[:2])
                ts.seconds, ts.nanos = s, n
            continue
        if sub is not None:
            if depth > 3:
                continue
            if f.is_repeated:
                for _ in range(rng.randint(0, 3)):
                    _fill(getattr(msg, f.name).add(), rng, bad, depth + 1)
            else:
                _fill(getattr(msg, f.name), rng, bad, depth + 1)
                getattr(msg, f.name).SetInParent()
            continue
        values = [_scalar(f, rng) for _ in range(rng.randint(0, 3) if f.is_repeated else 1)]
        if rng.random() >= bad:
            values = [v for v in values if _keeps(f, v)]
        if f.is_repeated:
            getattr(msg, f.name).extend(values)
        elif values:
            setattr(msg, f.name, values[0])


def _keeps(f: FieldDescriptor, v: Any) -> bool:
    try:
        check = validate._scalar_check(f)
        if check is not None:
            check(f.name, v)
    except InvalidArgument:
        return False
    return True


def _outcome(fn: Any, msg: Any) -> str | None:
    try:
        fn(msg)
    except InvalidArgument as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("desc", _types(), ids=lambda d: d.full_name)
def test_the_compiled_check_refuses_what_the_walk_refuses(desc: Descriptor) -> None:
    cls = _class_of(desc)
    rng = random.Random(desc.full_name)
    for round_ in range(150):
        msg = cls()
        _fill(msg, rng, bad=0.0 if round_ % 3 == 0 else 0.15)
        walked = _outcome(_walk, msg)
        if _compiled(desc)(msg):
            assert walked is None, (msg, walked)
        assert _outcome(validate_message, msg) == walked
        if round_ % 3 == 0:
            # Every value keeps its rule: the compiled check alone says so.
            assert walked is None
            assert _compiled(desc)(msg), msg


def _class_of(desc: Descriptor) -> Any:
    names = desc.full_name.removeprefix("tide.v1.").split(".")
    for mod in _MODULES:
        if mod.DESCRIPTOR.package == "tide.v1" and hasattr(mod, names[0]):
            obj: Any = mod
            for n in names:
                obj = getattr(obj, n)
            if obj.DESCRIPTOR is desc:
                return obj
    raise AssertionError(desc.full_name)


def test_a_report_of_the_agents_passes_the_compiled_check_alone() -> None:
    r = telemetry_pb2.NodeReport(node_name="gpu-node-1", boot_id="b-1", seq=3, gpu_capacity=8)
    r.sampled_at.GetCurrentTime()
    for i in range(8):
        g = r.gpus.add(index=i, uuid=f"GPU-{i}", utilization_pct=55.0, temperature_c=-5.0)
        g.pod.namespace, g.pod.name, g.pod.uid = "ml", f"bert-{i // 4}", f"uid-{i // 4}"
        if i % 2:
            g.sm_active_pct = 0.0
    assert _compiled(r.DESCRIPTOR)(r)
    # A GPM field set to NaN is refused; unset, it reads NaN and is not.
    r.gpus[3].tensor_active_pct = math.nan
    assert not _compiled(r.DESCRIPTOR)(r)
    with pytest.raises(InvalidArgument, match=r"^gpus\[3\]\.tensor_active_pct: must be finite"):
        validate_message(r)


_PURE_PYTHON_REPORT = """
import math
from google.protobuf.internal import api_implementation
from tide.base.errors import InvalidArgument
from tide.services.common.validate import validate_message
from tide.v1 import telemetry_pb2

assert api_implementation.Type() == "python", api_implementation.Type()
r = telemetry_pb2.NodeReport(node_name="n1", boot_id="b", seq=1, gpu_capacity=2)
r.gpus.add(index=0, utilization_pct=5.0, sm_active_pct=40.0)
r.gpus.add(index=1, utilization_pct=5.0)
validate_message(r)
r.gpus[1].tensor_active_pct = math.nan
try:
    validate_message(r)
except InvalidArgument as exc:
    print("refused:", exc)
"""


def test_the_compiled_check_runs_under_the_pure_python_protobuf() -> None:
    # PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python (a common workaround in ML images)
    # gives each message class its own HasField: one called unbound on another type
    # raised ValueError, INTERNAL for every agent report. The backend is chosen at
    # import, hence a fresh interpreter.
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    done = subprocess.run(
        [sys.executable, "-c", _PURE_PYTHON_REPORT],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: gpus[1].tensor_active_pct: must be finite"), done.stdout


def _dynamic_class(name: str, fields: list[tuple[str, int, int, str]]) -> Any:
    """A message class ``rv.<name>`` built in a pool of its own: fields are (name,
    number, type, type_name), singular."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{name}.proto", package="rv", syntax="proto3")
    m = fdp.message_type.add(name=name)
    for fname, number, ftype, type_name in fields:
        f = m.field.add(name=fname, number=number, type=ftype, label=1)
        if type_name:
            f.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"rv.{name}"))


def test_a_recursive_type_is_checked_as_deep_as_it_is_set() -> None:
    # Below the inline depth an unset sub-message was checked too: a type holding
    # itself recursed until RecursionError.
    node_cls = _dynamic_class(
        "Node",
        [
            ("child", 1, FieldDescriptor.TYPE_MESSAGE, ".rv.Node"),
            ("pod_name", 2, FieldDescriptor.TYPE_STRING, ""),
        ],
    )
    root = node_cls(pod_name="ok")
    validate_message(root)
    leaf = root
    for _ in range(8):
        leaf = leaf.child
        leaf.pod_name = "ok"
    assert _compiled(root.DESCRIPTOR)(root)
    leaf.pod_name = "bad name"
    assert not _compiled(root.DESCRIPTOR)(root)
    with pytest.raises(InvalidArgument, match=r"^" + r"child\." * 8 + r"pod_name: not a valid"):
        validate_message(root)


def test_two_types_of_one_name_each_get_their_own_check() -> None:
    # Checks kept by full name let a second type of that name (another pool) with
    # more fields pass on the first type's check, its extra fields unchecked.
    pod = ("pod_name", 1, FieldDescriptor.TYPE_STRING, "")
    narrow = _dynamic_class("Msg", [pod])
    wide = _dynamic_class("Msg", [pod, ("node_name", 2, FieldDescriptor.TYPE_STRING, "")])
    assert narrow.DESCRIPTOR.full_name == wide.DESCRIPTOR.full_name
    validate_message(narrow(pod_name="ok"))
    with pytest.raises(InvalidArgument, match=r"^node_name: not a valid node_name"):
        validate_message(wide(pod_name="ok", node_name="bad name/../x"))
