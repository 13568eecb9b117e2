"""The leader lease in SQL, shared with the coordinator: services/store/leases.py."""

from services.store.leases import (
    LeaseRecord,
    live_leases,
    read_lease,
    release_lease,
    try_lease,
)

__all__ = ["LeaseRecord", "live_leases", "read_lease", "release_lease", "try_lease"]
