"""Watches over the API server emulator's store: replay from a resourceVersion out of
the bounded history, then follow new changes until ``timeoutSeconds``; the 410 Gone
(an ERROR event) for a resourceVersion older than the history; and the faults that
act on watches (compaction, dropped and hung watches, changes seen all at once).

Its own room because the history's semantics (what a watcher that fell behind
gets) change together and apart from the writes that feed it (``store.py``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

from tide.services.testing.kube.resources import ResourceType
from tide.services.testing.kube.semantics import ApiError, Obj, field_matcher, label_matcher
from tide.services.testing.kube.store import ObjectStore, _Change


class WatchableStore(ObjectStore):
    """The store with its watches and the faults that act on them."""

    # -- faults ---------------------------------------------------------------------------

    def hang_watches(self, hang: bool = True) -> None:
        """New watches send their headers and then nothing until the server closes:
        a dead path that only the client's own read timeout gets it out of."""
        with self._cond:
            self.blackhole = hang

    def compact(self) -> None:
        """Forget the history: a watch from any resourceVersion given out before now gets
        410. (The revision moves on by one, as a compaction's own write would, so that
        a list made after it is watchable and a watcher fully caught up still expires.)"""
        with self._cond:
            self._rv += 1
            self._history.clear()
            self._oldest_rv = self._rv

    @contextlib.contextmanager
    def all_at_once(self) -> Iterator[None]:
        """Watches see nothing of the changes made inside until it ends, then all of
        them together. With :meth:`compact` (and :meth:`drop_watches`) inside, every
        watcher is behind a compaction for changes it never saw: the 410 Gone a slow
        watcher meets on a real cluster, with the changes it must list again."""
        with self._cond:
            yield

    def drop_watches(self) -> None:
        """End every open watch (an API server restart, a load balancer's idle cut)."""
        with self._cond:
            self._watch_epoch += 1
            self._cond.notify_all()

    # -- watch ----------------------------------------------------------------------------

    def watch(
        self,
        t: ResourceType,
        ns: str,
        since: str,
        labels: str,
        fields: str,
        timeout_s: float,
    ) -> Iterator[tuple[str, Obj]]:
        """(type, object) events; ("ERROR", Status) with 410 when ``since`` is too old."""
        lm, fm = label_matcher(labels), field_matcher(fields)

        def matches(c: _Change) -> bool:
            md = c.obj["metadata"]
            return (
                (c.rtype.group, c.rtype.plural) == (t.group, t.plural)
                and (not ns or md.get("namespace", "") == ns)
                and lm(md.get("labels") or {})
                and fm(c.obj)
            )

        deadline = time.monotonic() + timeout_s
        expired: Obj | None = None
        with self._cond:
            epoch = self._watch_epoch
            if since in ("", "0"):
                items, rv = self.list(t, ns, labels, fields)
                pending: list[tuple[str, Obj]] = [("ADDED", o) for o in items]
                sent = rv
            else:
                try:
                    sent = int(since)
                except ValueError:
                    raise ApiError(
                        400, "BadRequest", f"invalid resourceVersion {since!r}"
                    ) from None
                pending = []
                if self._missed(sent):
                    self.stats.gone += 1
                    expired = ApiError(
                        410, "Expired", f"too old resource version: {sent} ({self._oldest_rv})"
                    ).status()
        if expired is not None:
            yield "ERROR", expired
            return
        yield from pending
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda sent=sent: (  # type: ignore[misc]
                        self._closing
                        or self._watch_epoch != epoch
                        or bool(self._history and self._history[-1].rv > sent)
                    ),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if self._closing or self._watch_epoch != epoch:
                    return
                if self._missed(sent):
                    # The history moved past this watch while it was behind.
                    self.stats.gone += 1
                    expired = ApiError(410, "Expired", "too old resource version").status()
                    break
                fresh = [c for c in self._history if c.rv > sent]
            for c in fresh:
                sent = c.rv
                if matches(c):
                    yield c.type, copy.deepcopy(c.obj)
            if time.monotonic() >= deadline:
                return
        assert expired is not None
        yield "ERROR", expired

    def _missed(self, sent: int) -> bool:
        """True when changes after ``sent`` are no longer in the history (410)."""
        if self._history:
            return self._history[0].rv > sent + 1
        return sent < self._oldest_rv
