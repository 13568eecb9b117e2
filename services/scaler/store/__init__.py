"""The scaler's store: every read and write of jobs, decisions, events and rollups.

The repository functions (``jobs``, ``decisions``, ``pages``, ``rollups``) take
an open Session first and never commit: the caller owns the transaction
(``services.store.db.session_scope`` or ``unit_of_work``), so a state change,
its event row and its fencing check commit together or not at all. They
return frozen records (``records``); ORM objects never leave this package.
:class:`DecisionStore` is the scaler's async unit-of-work layer over them.
Readers such as the CLI's ``--db`` mode call the functions directly.
"""

from services.scaler.errors import (
    DecisionChanged,
    DecisionInProgress,
    DecisionNotFound,
    JobNotFound,
    StaleEpoch,
)
from services.scaler.store.decision_store import DecisionStore
from services.scaler.store.decisions import (
    active_decision,
    active_decisions,
    create_decision,
    delete_decisions_before,
    get_decision,
    last_completed_decisions,
    last_resize_end,
    non_final_decisions,
    transition_decision,
)
from services.scaler.store.jobs import (
    acquire_job_ownership,
    acquire_jobs_ownership,
    check_epoch,
    get_job,
    list_jobs,
    set_job_observed,
    set_paused,
    upsert_job,
)
from services.scaler.store.pages import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, list_decisions
from services.scaler.store.records import (
    DECISION_LIFECYCLE,
    FINAL_STATES,
    DecisionDetailRecord,
    DecisionEventRecord,
    DecisionPage,
    DecisionRecord,
    DecisionState,
    JobRecord,
    RollupRecord,
)
from services.scaler.store.rollups import (
    delete_rollups_before,
    delete_seconds_before,
    merge_rollups,
    rollups_between,
    seconds_between,
    write_rollups,
)
from services.scaler.store.rows import JOBS, ROLLUPS, validate_job_id

__all__ = [
    "DECISION_LIFECYCLE",
    "DEFAULT_PAGE_SIZE",
    "FINAL_STATES",
    "JOBS",
    "MAX_PAGE_SIZE",
    "ROLLUPS",
    "DecisionChanged",
    "DecisionDetailRecord",
    "DecisionEventRecord",
    "DecisionInProgress",
    "DecisionNotFound",
    "DecisionPage",
    "DecisionRecord",
    "DecisionState",
    "DecisionStore",
    "JobNotFound",
    "JobRecord",
    "RollupRecord",
    "StaleEpoch",
    "acquire_job_ownership",
    "acquire_jobs_ownership",
    "active_decision",
    "active_decisions",
    "check_epoch",
    "create_decision",
    "delete_decisions_before",
    "delete_rollups_before",
    "delete_seconds_before",
    "get_decision",
    "get_job",
    "last_completed_decisions",
    "last_resize_end",
    "list_decisions",
    "list_jobs",
    "merge_rollups",
    "non_final_decisions",
    "rollups_between",
    "seconds_between",
    "set_job_observed",
    "set_paused",
    "transition_decision",
    "upsert_job",
    "validate_job_id",
    "write_rollups",
]
