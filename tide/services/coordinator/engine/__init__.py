"""The coordinator's engine, one module per thing that changes together.

- :mod:`.coordinator`: every job's runtime and the tick loop;
- :mod:`.job`: one job's operations (register, heartbeat, ack, resize, tick, restart);
- :mod:`.phases`: the resize-phase table, one handler per phase;
- :mod:`.membership` and :mod:`.recovery`: the rules of members and of losses;
- :mod:`.effects`: what the rules decide, as data;
- :mod:`.outbox`: the one place that performs effects and commits them;
- :mod:`.state` and :mod:`.views`: the job's state and its read-only views;
- :mod:`.messages`: the inputs and views the servicer converts;
- :mod:`.streams`: Directives, Resize and WatchJob as async iterators.
"""

from tide.services.coordinator.engine import streams
from tide.services.coordinator.engine.coordinator import Coordinator
from tide.services.coordinator.engine.job import JobRuntime
from tide.services.coordinator.engine.messages import (
    AckInput,
    HeartbeatInput,
    JobView,
    MemberView,
    RegisterInput,
    RegisterResult,
    ResizeInput,
    ResizeView,
)

__all__ = [
    "AckInput",
    "Coordinator",
    "HeartbeatInput",
    "JobRuntime",
    "JobView",
    "MemberView",
    "RegisterInput",
    "RegisterResult",
    "ResizeInput",
    "ResizeView",
    "streams",
]
