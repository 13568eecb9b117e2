"""Fixed-size reference runs shared by the tests of one pytest session.

Several parity tests compare their elastic job with the same plain run (one example, the
same arguments, the same world size): the parameters of one test, or two tests of a module.
:class:`ReferenceRuns` runs each distinct one once under a directory that every xdist
worker of the session shares, behind a file lock: the first worker to need it runs it, the
others wait on the lock and read the finished run. A failed run is not kept, so the next
caller runs it again and sees its own failure.

Opt-in only: :func:`tide.services.testing.localjob.reference_run` itself never shares, since a
determinism test (two runs compared) and the benchmarks must run every time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tide.services.testing.localjob import EXAMPLE, ROOT, reference_run

# What a reference run's result depends on besides its own script and arguments: the code
# the example scripts import. Hashed so a run is never reused across a change to it (the
# tree is shared with other engineers, who edit it while a session runs).
_CODE = ("tide/trainer", "tide/base")


def code_digest(example: str) -> str:
    """A digest of ``example`` and every Python file under the packages it imports."""
    h = hashlib.sha256()
    missing = [d for d in _CODE if not (ROOT / d).is_dir()]
    if missing:
        # A moved package would drop out of the key silently and a stale run be reused.
        raise FileNotFoundError(f"reference runs: no package folder {missing} under {ROOT}")
    files = [Path(example), *(p for d in _CODE for p in sorted((ROOT / d).rglob("*.py")))]
    for path in files:
        h.update(str(path).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def run_key(example: str, train_args: Sequence[str], world_size: int) -> str:
    """The name of a run in the cache: what it ran, on which code."""
    spec = json.dumps(
        {
            "example": str(Path(example).resolve()),
            "code": code_digest(example),
            "args": list(train_args),
            "world": world_size,
        },
        sort_keys=True,
    )
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


class ReferenceRuns:
    """Reference runs cached under ``root`` (one directory for a whole pytest session)."""

    def __init__(self, root: Path, shared: bool = True) -> None:
        self.root = root
        # Unshared, every call runs its own (the cost the cache saves, for a comparison).
        self.shared = shared

    def __call__(
        self,
        train_args: Sequence[str],
        world_size: int = 2,
        example: str = EXAMPLE,
        timeout_s: float = 120.0,
    ) -> Path:
        """The log directory of the fixed-size run (its checkpoints are in the sibling
        ``ckpt``), run now unless this session already ran it. Read it only: its files are
        read-only, and other tests read the same run."""
        key = run_key(example, train_args, world_size)
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.shared:
            own = Path(tempfile.mkdtemp(prefix=f"{key}.own-", dir=self.root))
            return reference_run(own, train_args, world_size, timeout_s, example)
        done = self.root / key
        with open(self.root / f"{key}.lock", "w") as lock:
            # Blocks while another worker runs it: that wait replaces a run of our own.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.is_dir():
                work = self.root / f"{key}.run-{os.getpid()}"
                shutil.rmtree(work, ignore_errors=True)
                # A failure raises here, before the rename: the next caller runs it again.
                reference_run(work, train_args, world_size, timeout_s, example)
                _read_only(work)
                work.rename(done)
        return done / "logs"


def _read_only(tree: Path) -> None:
    """Make every file under ``tree`` read-only, so a test that wrote into a shared run
    fails rather than changing what the others compare with. Directories stay writable so
    that pytest's clean-up of old sessions can remove them."""
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
