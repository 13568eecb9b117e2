"""A member registry tests fill by hand (the real one follows the coordinator's WatchJob)."""

from __future__ import annotations

from services.scaler.members import MemberIndex


class InMemoryMemberRegistry(MemberIndex):
    """services.scaler.members.MemberRegistry as plain data: ``set_members`` replaces
    one job's members; nothing follows a coordinator."""
