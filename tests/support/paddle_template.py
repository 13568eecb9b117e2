"""One Paddle template for each pytest process (tide/trainer/template.py).

The suite starts hundreds of processes that import Paddle: each launcher's zygote, the
reference runs, the tests' own gloo ranks. `import paddle` alone costs 1.5-1.8 CPU-s here,
which made Paddle's import the largest share of the suite's CPU (docs/reliability.md, "Where the suite's
CPU goes"). With ``TIDE_PADDLE_TEMPLATE`` in the environment, every zygote a launcher starts
and every script run through :func:`tide.trainer.template.popen` is forked from this process
instead. ``TIDE_TEST_PADDLE_TEMPLATE=0`` runs the suite without it (every process imports
Paddle itself, as a pod does on a cluster).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tide.trainer.template import ENV_TEMPLATE

_started: tuple[subprocess.Popen[bytes], str] | None = None


def start() -> None:
    """Start this process's template (without waiting: a caller that comes before it has
    imported waits in its socket's backlog) and name it to every process started after."""
    global _started
    if _started is not None or os.environ.get("TIDE_TEST_PADDLE_TEMPLATE", "1") == "0":
        return
    if os.environ.get(ENV_TEMPLATE):
        # A pytest run inside a test: the outer session's template serves it too.
        return
    where = tempfile.mkdtemp(prefix="tide-template-")
    path = os.path.join(where, "socket")
    with open(os.path.join(where, "template.log"), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tide.trainer.template", "--socket", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    _started = (proc, where)
    # Bound at once, before its import: from then on a caller waits for it rather than
    # importing Paddle itself.
    deadline = time.monotonic() + 10.0
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.environ[ENV_TEMPLATE] = path


def pids() -> list[int]:
    return [] if _started is None else [_started[0].pid]


def stop() -> None:
    global _started
    if _started is None:
        return
    proc, where = _started
    _started = None
    os.environ.pop(ENV_TEMPLATE, None)
    if proc.poll() is not None:
        # It died during the session: every caller since imported Paddle itself. Say why.
        with open(os.path.join(where, "template.log"), errors="replace") as log:
            tail = log.read()[-2000:]
        print(
            f"tests/support/paddle_template: the template ended early ({proc.returncode}):\n{tail}",
            file=sys.__stderr__,
        )
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    shutil.rmtree(where, ignore_errors=True)
