"""`python -m trainer.launch`, kept for one release: the launcher moved to
`python -m tide.trainer.launch` (docs/packaging.md). Warns on stderr, then runs it
with the same arguments."""

from __future__ import annotations

import runpy
import sys

MOVED = (
    "tide: `python -m trainer.launch` is deprecated and goes in the next release: "
    "the launcher moved to `python -m tide.trainer.launch` (uninstall "
    "tide-trainer-compat once your manifests name it)"
)


def main() -> None:
    print(MOVED, file=sys.stderr, flush=True)
    # alter_sys: the launcher sees itself as __main__ with the same sys.argv.
    runpy.run_module("tide.trainer.launch", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
