"""The scaler's errors: subclasses of tide.base.errors, so gRPC maps each to its status.

A move its lifecycle table does not have is not here: that is a bug, and raises
tide.base.lifecycle.InvalidTransition (INTERNAL)."""

from __future__ import annotations

from tide.base.errors import Conflict, FailedPrecondition, NotFound, Unavailable


class JobNotFound(NotFound):
    pass


class DecisionNotFound(NotFound):
    pass


class StaleEpoch(Conflict):
    """Another scaler took the job since this one acquired it; this one must stop acting on it."""


class DecisionChanged(Conflict):
    """A decision's state changed under the writer (it read one state, the row holds
    another): a race with another writer, not a bug; re-read and decide again."""


class DecisionInProgress(FailedPrecondition):
    """The job already has a decision that is not final."""


class NotLeader(Unavailable):
    """A follower replica was asked to write: retry, through the Service, at the leader."""


class NotOwner(Unavailable):
    """A sharded replica was asked to write for a job whose shard another replica holds:
    retry at the owner the message names (docs/scaler.md, Scaling out)."""
