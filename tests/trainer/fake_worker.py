"""A stand-in worker without Paddle: speaks the launcher channel like tide.trainer.session does."""

from __future__ import annotations

import os
import signal
import sys
import time

from tide.trainer.channel import SocketChannel
from tide.trainer.messages import (
    CheckpointAt,
    CheckpointInfo,
    CheckpointWritten,
    Done,
    Exit,
    Go,
    Held,
    Hello,
    Prepared,
    Progress,
    Ready,
    Rendezvous,
    Resume,
    Resumed,
    Start,
)


def _wait(ch: SocketChannel, kind: type[Start] | type[Go]) -> bool:
    """Until ``kind`` arrives (its env applied); False when told to exit."""
    while True:
        msg = ch.wait(0.1)
        if ch.closed or isinstance(msg, Exit):
            return False
        if isinstance(msg, kind):
            os.environ.update(msg.env)
            return True


def main() -> int:
    ch = SocketChannel(os.environ["TIDE_CONTROL_SOCKET"])
    ch.send(Hello(pid=os.getpid()))
    if os.environ.get("TIDE_PREWARM") == "1":
        # Forked ahead of time: wait to be told the generation, as tide.trainer.session does.
        while True:
            msg = ch.wait(0.1)
            if ch.closed or isinstance(msg, Exit):
                return 0
            if isinstance(msg, Rendezvous):
                os.environ.update(msg.env)
                break
    if os.environ.get("TIDE_GENERATION") == os.environ.get("FAKE_HANG_IN_GENERATION"):
        # Stuck forming the group with a peer that is gone (gloo waits on it): deaf to Exit,
        # it only goes with the SIGKILL after the launcher's exit grace.
        time.sleep(3600)
    prepared = os.environ.get("TIDE_PREPARED") == "1"
    if prepared:
        # Overlap mode: "the group" is formed; restore on Start, train on Go.
        ch.send(Prepared(generation=int(os.environ["TIDE_GENERATION"]), group_init_s=0.01))
        if not _wait(ch, Start):
            return 0
    step = int(os.environ.get("TIDE_RESTORE_STEP", "0") or 0)
    # A newer checkpoint found on disk than the one the rendezvous named.
    step = max(step, int(os.environ.get("FAKE_RESTORE_AT_LEAST", "0")))
    # Like tide.trainer.session: a periodic checkpoint every N steps, "done" after the budget.
    ckpt_every = int(os.environ.get("FAKE_CKPT_EVERY", "0"))
    max_steps = int(os.environ.get("FAKE_MAX_STEPS", "0"))
    ch.send(Ready(restored_step=step, group_init_s=0.01, restore_s=0.02))
    if prepared and not _wait(ch, Go):
        return 0
    stop_at, ids = 0, tuple[str, ...]()
    if os.environ.get("FAKE_SEGFAULT_AT_FIRST_STEP") == "1":
        # Restored, then dies in its first backward, as a broken kernel or build does.
        print(f"step {step + 1}: backward", file=sys.stderr, flush=True)
        print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    while True:
        step += 1
        time.sleep(0.02)
        ch.send(Progress(step=step, cursor=step, samples_per_s=50.0, first_step_at=time.time()))
        if ckpt_every and step % ckpt_every == 0:
            ch.send(
                CheckpointWritten(step=step, digest=f"{step:064x}", write_s=0.01, periodic=True)
            )
        if max_steps and step >= max_steps:
            ch.send(Done(step=step))
            return 0
        while (msg := ch.poll()) is not None:
            if isinstance(msg, Exit):
                return 0
            if isinstance(msg, CheckpointAt):
                stop_at, ids = msg.step, (msg.directive_id,)
        if ch.closed:
            return 0
        if stop_at and step >= stop_at:
            info = CheckpointInfo(step=step, digest="ab" * 32, write_s=0.01)
            ch.send(Held(step=step, held_at=time.time(), directive_ids=ids, checkpoint=info))
            stop_at = 0
            while True:
                msg = ch.wait(1.0)
                if isinstance(msg, Exit):
                    return 0
                if isinstance(msg, Resume):
                    ch.send(Resumed(step=step))
                    break


if __name__ == "__main__":
    raise SystemExit(main())
