"""Stands in for `python -m tide.trainer.launch` in actuator tests.

It records its start and its SIGTERM (with a monotonic timestamp) in
$FAKE_LAUNCHER_LOG, keeps a "worker" child in its process group, and exits on
SIGTERM, unless $FAKE_IGNORE_TERM is set (then only SIGKILL ends it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def note(line: str) -> None:
    with open(os.environ["FAKE_LAUNCHER_LOG"], "a") as f:
        f.write(line + "\n")


def main() -> int:
    args = sys.argv[1:]
    cut = args.index("--")
    p = argparse.ArgumentParser()
    for flag in ("--coordinator", "--job", "--pod", "--pod-index", "--state-dir"):
        p.add_argument(flag, required=True)
    ns = p.parse_args(args[:cut])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    note(f"start {ns.pod_index} {ns.pod} {os.getpid()} {worker.pid} {' '.join(args[cut + 1 :])}")

    def on_term(signum: int, frame: object) -> None:
        note(f"term {ns.pod_index} {time.monotonic_ns()}")
        if not os.environ.get("FAKE_IGNORE_TERM"):
            worker.kill()
            worker.wait()
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    raise SystemExit(main())
