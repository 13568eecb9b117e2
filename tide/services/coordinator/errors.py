"""Errors of the coordinator domain; tide.base.errors maps them to gRPC codes."""

from __future__ import annotations

from tide.base.errors import FailedPrecondition, NotFound


class UnknownJob(NotFound):
    """No member has registered for the job and no resize names it."""


class UnknownMember(NotFound):
    """The member id was never handed out (or belongs to a forgotten job)."""


class UnknownDirective(NotFound):
    """The directive id was never sent to this member."""


class UnknownResize(NotFound):
    """No resize with this decision id."""


class StaleGeneration(FailedPrecondition):
    """An ack or request names a generation other than the one it must match (fencing)."""


class MemberGone(FailedPrecondition):
    """The member left or was declared dead; its launcher must register again."""


class ResizeInProgress(FailedPrecondition):
    """Another resize of the job is not final yet."""


class JobEnded(FailedPrecondition):
    """The job finished, or failed for good: a Resize of it is refused at once."""
