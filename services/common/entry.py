"""The entry point every gRPC service shares: settings, logging, run, exit code.

Exit codes: 0 after a clean shutdown, 2 for a bad setting (one line naming it),
1 when the service stops on a TideError (a store it cannot reach at start...).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from services.common import logs
from services.common.config import CommonSettings, load_settings
from tidebase.errors import ConfigError, TideError

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=CommonSettings)


def run_service(
    settings_cls: type[S],
    run: Callable[[S], Coroutine[Any, Any, None]],
    *,
    name: str,
    description: str,
    argv: Sequence[str] | None = None,
) -> int:
    try:
        settings = load_settings(
            settings_cls, argv, prog=f"python -m services.{name}", description=description
        )
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        asyncio.run(run(settings))
    except TideError as exc:
        # One line, not a traceback: this is the environment, not a bug.
        logger.error("%s stopped: %s", name, exc)
        return 1
    return 0
