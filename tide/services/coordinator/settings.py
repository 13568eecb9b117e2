"""Settings of the coordinator: the service's (flags, env, file) and the tuning
that the domain core takes."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields

from tide.base.errors import ConfigError
from tide.services.common.config import CommonSettings, setting
from tide.services.store.leader import LeaseSettings


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: must be > 0, got {value!r}")


RESIZE_MODES = ("plain", "overlap")
PREPARE_FALLBACKS = ("plain", "abort")


@dataclass(frozen=True)
class Tuning:
    """The timing rules of the coordinator core (see docs/coordinator.md)."""

    # A member without heartbeat this long is lost; also each member's ack deadline.
    heartbeat_timeout_s: float = 60.0
    # Each phase's deadline of a resize whose request says deadline_s 0. Not the member
    # silence above: a barrier over slow checkpoints may need longer than a heartbeat gap.
    phase_timeout_s: float = 60.0
    # Launchers heartbeat this often; a fifth of heartbeat_timeout_s leaves four misses.
    heartbeat_interval_s: float = 5.0
    # The checkpoint step is at least this many steps past the highest reported one.
    checkpoint_min_lead_steps: int = 2
    # ...and far enough ahead that the fastest member cannot pass it before hearing
    # the directive: one heartbeat interval of staleness plus delivery.
    checkpoint_lead_s: float = 6.0
    # How often deadlines and heartbeat timeouts are checked.
    tick_interval_s: float = 0.5
    # "plain": g+1's group forms after the barrier, inside the pause. "overlap": a PREPARE
    # phase has g+1's standby workers form it while g trains (docs/resize-protocol.md).
    resize_mode: str = "plain"
    # Overlap mode, when a standby misses the PREPARE deadline or nacks: "plain" carries the
    # resize on through the plain barrier, "abort" aborts it with g untouched.
    prepare_fallback: str = "plain"
    # The crash-loop limit (docs/trainer.md, "Restarts and their budget"): a generation an
    # unplanned loss broke (a crashed worker or a silent member: either re-forms the job)
    # is re-formed at most this many times in a row; one more loss and the job is FAILED. A generation that ran restart_reset_after_s before it
    # broke starts the count again (as Kubernetes' CrashLoopBackOff after 10 minutes).
    restart_budget: int = 5
    # The n-th re-form in a row starts its workers initial * 2^(n-1) seconds late, at most
    # max: a worker that dies at every start cannot make the job re-form once a second.
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    restart_reset_after_s: float = 600.0

    def __post_init__(self) -> None:
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(
                f"resize_mode: must be one of {', '.join(RESIZE_MODES)}, got {self.resize_mode!r}"
            )
        if self.prepare_fallback not in PREPARE_FALLBACKS:
            raise ConfigError(
                f"prepare_fallback: must be one of {', '.join(PREPARE_FALLBACKS)}, "
                f"got {self.prepare_fallback!r}"
            )
        _positive("heartbeat_timeout_s", self.heartbeat_timeout_s)
        _positive("phase_timeout_s", self.phase_timeout_s)
        _positive("heartbeat_interval_s", self.heartbeat_interval_s)
        _positive("tick_interval_s", self.tick_interval_s)
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s: must be below heartbeat_timeout_s ({self.heartbeat_timeout_s!r}), "
                f"got {self.heartbeat_interval_s!r}"
            )
        if self.checkpoint_min_lead_steps < 1:
            raise ConfigError(
                f"checkpoint_min_lead_steps: must be >= 1, got {self.checkpoint_min_lead_steps!r}"
            )
        if self.checkpoint_lead_s < 0:
            raise ConfigError(f"checkpoint_lead_s: must be >= 0, got {self.checkpoint_lead_s!r}")
        if self.restart_budget < 0:
            raise ConfigError(f"restart_budget: must be >= 0, got {self.restart_budget!r}")
        _positive("restart_backoff_initial_s", self.restart_backoff_initial_s)
        _positive("restart_reset_after_s", self.restart_reset_after_s)
        if self.restart_backoff_max_s < self.restart_backoff_initial_s:
            raise ConfigError(
                f"restart_backoff_max_s: must be >= restart_backoff_initial_s "
                f"({self.restart_backoff_initial_s!r}), got {self.restart_backoff_max_s!r}"
            )
        if self.restart_reset_after_s <= self.restart_backoff_max_s:
            # A generation waiting out its backoff would look like a healthy run.
            raise ConfigError(
                f"restart_reset_after_s: must exceed restart_backoff_max_s "
                f"({self.restart_backoff_max_s!r}), got {self.restart_reset_after_s!r}"
            )

    def restart_delay_s(self, restarts: int) -> float:
        """How late the workers of the ``restarts``-th re-form in a row start, seconds."""
        if restarts < 1:
            return 0.0
        return min(
            self.restart_backoff_max_s,
            self.restart_backoff_initial_s * 2.0 ** min(restarts - 1, 60),
        )

    def lead_problem(self) -> str:
        """Why the checkpoint lead is too short for the heartbeat interval, or "".

        Not a ConfigError: tests with fake launchers that report every step use short
        leads on purpose. Real workers report steps up to one interval old, and with a lead
        below it they pass the checkpoint step before they hear it, so barriers abort."""
        if self.checkpoint_lead_s > self.heartbeat_interval_s:
            return ""
        return (
            f"checkpoint_lead_s ({self.checkpoint_lead_s!r}) should exceed heartbeat_interval_s "
            f"({self.heartbeat_interval_s!r}): workers would pass the checkpoint step before "
            "hearing it and resizes would abort"
        )


_DEFAULT = Tuning()
_LEASE = LeaseSettings()
#: How replicas elect their leader: not at all (one replica), or a lease row in the store.
LEADER_ELECTIONS = ("off", "sql")
LEASE_NAME = "tide-coordinator"
#: The README's store, shared with the scaler and the CLI; make_engine creates .tide/.
DEFAULT_DB = "sqlite:///.tide/tide.db"


@dataclass(frozen=True)
class CoordinatorSettings(CommonSettings):
    """Everything `python -m tide.services.coordinator` accepts; the timing defaults are Tuning's."""

    db: str = setting(
        DEFAULT_DB, "SQLAlchemy URL of the coordinator's database (SQLite file or PostgreSQL)"
    )
    heartbeat_timeout_s: float = setting(
        _DEFAULT.heartbeat_timeout_s,
        "a member silent this long is lost (also its ack deadline), seconds",
    )
    phase_timeout_s: float = setting(
        _DEFAULT.phase_timeout_s,
        "deadline of each resize phase when a Resize asks for deadline_s 0, seconds",
    )
    heartbeat_interval_s: float = setting(
        _DEFAULT.heartbeat_interval_s, "how often launchers heartbeat, seconds"
    )
    checkpoint_min_lead_steps: int = setting(
        _DEFAULT.checkpoint_min_lead_steps,
        "the coordinated checkpoint step is at least this far past the highest reported step",
    )
    checkpoint_lead_s: float = setting(
        _DEFAULT.checkpoint_lead_s,
        "seconds of training the checkpoint step is placed ahead (converted with step rate)",
    )
    tick_interval_s: float = setting(
        _DEFAULT.tick_interval_s, "how often deadlines and timeouts are checked, seconds"
    )
    resize_mode: str = setting(
        _DEFAULT.resize_mode,
        "plain, or overlap: g+1's process group forms in standby workers while g trains",
    )
    prepare_fallback: str = setting(
        _DEFAULT.prepare_fallback,
        "overlap mode, a standby that misses the PREPARE deadline or nacks: plain or abort",
    )
    restart_budget: int = setting(
        _DEFAULT.restart_budget,
        "re-forms in a row after worker failures before the job is FAILED (crash-loop limit)",
    )
    restart_backoff_initial_s: float = setting(
        _DEFAULT.restart_backoff_initial_s,
        "the first re-form after a worker failure starts its workers this late, seconds"
        " (doubling with each re-form in a row)",
    )
    restart_backoff_max_s: float = setting(
        _DEFAULT.restart_backoff_max_s, "the longest restart backoff, seconds"
    )
    restart_reset_after_s: float = setting(
        _DEFAULT.restart_reset_after_s,
        "a generation that ran this long before it broke starts the restart count again, seconds",
    )

    leader_election: str = setting(
        "off",
        "off (one replica); sql: replicas elect a leader through a lease row in the store,"
        " the others stand by (not ready, calls get UNAVAILABLE) and take over",
    )
    lease_name: str = setting(
        LEASE_NAME, "leader election: the lease's name (one per set of replicas)"
    )
    lease_duration_s: float = setting(
        _LEASE.duration_s, "leader election: a lease not renewed for this long can be taken"
    )
    lease_renew_s: float = setting(
        _LEASE.renew_s, "leader election: how often the leader renews and a standby tries"
    )
    owner_id: str = setting("", "this replica's name in the lease; default host:pid")
    advertise_address: str = setting(
        "", "HOST:PORT a standby's health and errors name for the leader; default: listen"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.db:
            raise ConfigError("db: a database URL is required, got ''")
        if self.leader_election not in LEADER_ELECTIONS:
            raise ConfigError(f"leader_election: expected off or sql, got {self.leader_election!r}")
        if not self.lease_name:
            raise ConfigError("lease_name: must not be empty, got ''")
        self.tuning()
        self.lease()

    def lease(self) -> LeaseSettings:
        return LeaseSettings(duration_s=self.lease_duration_s, renew_s=self.lease_renew_s)

    def owner(self) -> str:
        return self.owner_id or f"{socket.gethostname()}:{os.getpid()}"

    def tuning(self) -> Tuning:
        return Tuning(**{f.name: getattr(self, f.name) for f in fields(Tuning)})
