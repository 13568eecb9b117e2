"""The scaler's leader election: the shared elector of services/store/leader.py under
the scaler's lease name.

The leader takes every job (bumping each job's owner epoch, the fencing token its
writes carry), resumes their decisions and evaluates them. The others follow: they
serve health and reads, and take over once the lease has expired. Either lease
backend (SQL row or Kubernetes Lease), the fencing epochs are the store's: whoever
is elected takes every job in SQL before it acts.
"""

from __future__ import annotations

from services.common.clock import Clock
from services.store.leader import LeaderElector as _Elector
from services.store.leader import LeaseBackend, LeaseSettings

LEASE_NAME = "tide-scaler"

__all__ = ["LEASE_NAME", "LeaderElector", "LeaseBackend", "LeaseSettings"]


class LeaderElector(_Elector):
    def __init__(
        self,
        backend: LeaseBackend,
        clock: Clock,
        settings: LeaseSettings,
        *,
        address: str,
        name: str = LEASE_NAME,
    ) -> None:
        super().__init__(backend, clock, settings, address=address, name=name)
