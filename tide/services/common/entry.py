"""The entry point every Tide service shares: settings, logging, run, exit code.

Exit codes: 0 after a clean shutdown, 2 for a bad setting (one line naming it),
1 when the service stops on a TideError (a store it cannot reach at start...),
or whatever non-zero code ``run`` returns (the agent: a task of it died).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from tide.base.errors import ConfigError, TideError
from tide.services.common import logs, tracing
from tide.services.common.config import ProcessSettings, load_settings
from tide.services.common.metrics import version

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=ProcessSettings)


def run_service(
    settings_cls: type[S],
    run: Callable[[S], Coroutine[Any, Any, int | None]],
    *,
    name: str,
    description: str,
    argv: Sequence[str] | None = None,
    error_prefix: str = "",
) -> int:
    """Load ``settings_cls`` (``python -m tide.services.<name>``), configure logs, run.

    ``error_prefix`` starts the one line of a bad setting (default: ``name``)."""
    try:
        settings = load_settings(
            settings_cls, argv, prog=f"python -m tide.services.{name}", description=description
        )
    except ConfigError as exc:
        print(f"{error_prefix or name}: {exc}", file=sys.stderr)
        return 2
    check = getattr(settings, "security_problem", None)
    if check is not None and (problem := check()):
        print(f"{error_prefix or name}: {problem}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    tracing.configure(name, getattr(settings, "otlp_endpoint", ""), version=version())
    try:
        code = asyncio.run(run(settings))
    except TideError as exc:
        # One line, not a traceback: this is the environment, not a bug.
        logger.error("%s stopped: %s", name, exc)
        return 1
    finally:
        tracing.shutdown()
    return code or 0
