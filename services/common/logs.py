"""Logging set-up shared by every service: text for people, JSON for collectors."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import MutableMapping
from typing import Any

#: Attributes a LoggerAdapter may attach; the JSON formatter lifts them to top-level keys.
CONTEXT_KEYS = ("job_id", "node", "member_id", "decision_id", "generation")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value is not None:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class ContextAdapter(logging.LoggerAdapter[logging.Logger]):
    """Prefixes messages with the ids it carries (``[job=ns/a] ...``) and attaches
    them to the record, so text logs read well and JSON logs can be filtered."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        ctx = dict(self.extra or {})
        prefix = " ".join(f"{k}={v}" for k, v in ctx.items() if v is not None)
        kwargs["extra"] = {**ctx, **kwargs.get("extra", {})}
        return (f"[{prefix}] {msg}" if prefix else msg), kwargs


def with_context(logger: logging.Logger, **ids: Any) -> ContextAdapter:
    return ContextAdapter(logger, ids)
