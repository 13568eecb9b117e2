"""The services' logging convention: ``tide.base.logs``, re-exported here for service code.

    from tide.services.common import logs

    logger = logging.getLogger(__name__)
    with logs.bound(job_id=job_id, decision_id=d.id):
        logger.info("...")          # the ids are fields of the line

The implementation sits in tide.base so that the trainer launcher, which may not
import services, writes the same lines (docs/architecture.md, "Logs").
"""

from __future__ import annotations

from tide.base.logs import (
    CONTEXT_KEYS,
    ContextAdapter,
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    bind,
    bind_process,
    bound,
    configure,
    current,
    rfc3339,
    with_context,
)

__all__ = [
    "CONTEXT_KEYS",
    "ContextAdapter",
    "ContextFilter",
    "JsonFormatter",
    "TextFormatter",
    "bind",
    "bind_process",
    "bound",
    "configure",
    "current",
    "rfc3339",
    "with_context",
]
