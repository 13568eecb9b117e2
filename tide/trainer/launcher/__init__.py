"""The launcher, split by what changes together (docs/trainer.md, "The launcher"):

- :mod:`.core`: :class:`Launcher`, the decisions (directives, the worker's messages, the
  lifecycle);
- :mod:`.link`: the coordinator (register, heartbeats, the directive stream, acks); the only
  launcher code that touches gRPC and protobuf;
- :mod:`.supervisor`: worker processes (zygote spawner, the prewarmed worker, stop, watch);
- :mod:`.control`: the control socket to the workers, carrying :mod:`tide.trainer.messages`;
- :mod:`.model`, :mod:`.settings`: the plain values they share.

``python -m tide.trainer.launch`` is the entry point.
"""

from tide.trainer.launcher.core import Launcher
from tide.trainer.launcher.model import LIFECYCLE, State
from tide.trainer.launcher.settings import LauncherSettings

__all__ = ["LIFECYCLE", "Launcher", "LauncherSettings", "State"]
