"""The guard's subject rule is written once, in :data:`BOUND_KINDS`: check_subject and the
guard's check of a unary request both read it, and a caller of another kind has its
request's subject neither read nor checked."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tide.services.common import guard
from tide.services.common.guard import (
    Guard,
    GuardSettings,
    Identity,
    Kind,
    Role,
    Rule,
    Subject,
    check_subject,
)

pytestmark = pytest.mark.unit


def test_check_subject_binds_only_the_bound_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = Identity(Kind.AGENT, "a", node="n1")
    monkeypatch.setattr(guard, "BOUND_KINDS", frozenset({Kind.LAUNCHER}))
    check_subject(agent, Subject(node="n2"))  # agents are not bound here any more


class _Context:
    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def test_a_unary_check_reads_the_subject_of_bound_kinds_only() -> None:
    read: list[Identity] = []

    def subject_of(_req: Any) -> Subject:
        read.append(who)
        return Subject(node=who.node)

    rule = Rule(frozenset({Kind.AGENT}), Role.VIEWER, subject_of)
    g = Guard(GuardSettings(insecure=True), {}, registry=CollectorRegistry())
    for who in (
        Identity(Kind.USER, "u", Role.ADMIN),
        Identity(Kind.SCALER, "s"),
        Identity(Kind.AGENT, "a", node="n1"),
    ):
        await g._check(_Context(), "/tide.v1.X/Y", rule, who, object())
    assert [w.kind for w in read] == [Kind.AGENT]
