"""A member registry tests fill by hand (the real one follows the coordinator's WatchJob)."""

from __future__ import annotations

from tide.services.scaler.members import MemberIndex


class InMemoryMemberRegistry(MemberIndex):
    """tide.services.scaler.members.MemberRegistry as plain data: ``set_members`` replaces
    one job's members; nothing follows a coordinator."""
