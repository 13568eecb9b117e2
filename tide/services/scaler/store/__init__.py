"""The scaler's store: every read and write of jobs, decisions, events and rollups.

The repository functions (``jobs``, ``decisions``, ``pages``, ``rollups``) take
an open Session first and never commit: the caller owns the transaction
(``tide.services.store.db.session_scope`` or ``unit_of_work``), so a state change,
its event row and its fencing check commit together or not at all. They
return frozen records (``records``); ORM objects never leave this package.
:class:`DecisionStore` is the scaler's async unit-of-work layer over them.
Readers such as the CLI's ``--db`` mode call the functions directly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tide.services.scaler.errors import (
    DecisionChanged,
    DecisionInProgress,
    DecisionNotFound,
    JobNotFound,
    StaleEpoch,
)
from tide.services.scaler.store.records import (
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

if TYPE_CHECKING:
    from tide.services.scaler.store.decision_store import (
        DecisionStore,
    )
    from tide.services.scaler.store.decisions import (
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
    from tide.services.scaler.store.jobs import (
        acquire_job_ownership,
        acquire_jobs_ownership,
        check_epoch,
        get_job,
        list_jobs,
        set_job_observed,
        set_paused,
        upsert_job,
    )
    from tide.services.scaler.store.pages import (
        DEFAULT_PAGE_SIZE,
        MAX_PAGE_SIZE,
        decision_rows,
        history_table_rows,
        list_decisions,
    )
    from tide.services.scaler.store.rollups import (
        delete_rollups_before,
        delete_seconds_before,
        merge_rollups,
        rollups_between,
        seconds_between,
        write_rollups,
    )
    from tide.services.scaler.store.rows import (
        JOBS,
        ROLLUPS,
        validate_job_id,
    )

# The SQL half loads on first use (PEP 562): readers that only need the records and
# errors (the CLI's converters, `tide --help`) do not pay for importing SQLAlchemy.
_LAZY = {
    "DecisionStore": "tide.services.scaler.store.decision_store",
    "active_decision": "tide.services.scaler.store.decisions",
    "active_decisions": "tide.services.scaler.store.decisions",
    "create_decision": "tide.services.scaler.store.decisions",
    "delete_decisions_before": "tide.services.scaler.store.decisions",
    "get_decision": "tide.services.scaler.store.decisions",
    "last_completed_decisions": "tide.services.scaler.store.decisions",
    "last_resize_end": "tide.services.scaler.store.decisions",
    "non_final_decisions": "tide.services.scaler.store.decisions",
    "transition_decision": "tide.services.scaler.store.decisions",
    "acquire_job_ownership": "tide.services.scaler.store.jobs",
    "acquire_jobs_ownership": "tide.services.scaler.store.jobs",
    "check_epoch": "tide.services.scaler.store.jobs",
    "get_job": "tide.services.scaler.store.jobs",
    "list_jobs": "tide.services.scaler.store.jobs",
    "set_job_observed": "tide.services.scaler.store.jobs",
    "set_paused": "tide.services.scaler.store.jobs",
    "upsert_job": "tide.services.scaler.store.jobs",
    "DEFAULT_PAGE_SIZE": "tide.services.scaler.store.pages",
    "MAX_PAGE_SIZE": "tide.services.scaler.store.pages",
    "list_decisions": "tide.services.scaler.store.pages",
    "decision_rows": "tide.services.scaler.store.pages",
    "history_table_rows": "tide.services.scaler.store.pages",
    "delete_rollups_before": "tide.services.scaler.store.rollups",
    "delete_seconds_before": "tide.services.scaler.store.rollups",
    "merge_rollups": "tide.services.scaler.store.rollups",
    "rollups_between": "tide.services.scaler.store.rollups",
    "seconds_between": "tide.services.scaler.store.rollups",
    "write_rollups": "tide.services.scaler.store.rollups",
    "JOBS": "tide.services.scaler.store.rows",
    "ROLLUPS": "tide.services.scaler.store.rows",
    "validate_job_id": "tide.services.scaler.store.rows",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "decision_rows",
    "delete_decisions_before",
    "delete_rollups_before",
    "delete_seconds_before",
    "get_decision",
    "get_job",
    "history_table_rows",
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
