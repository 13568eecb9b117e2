"""tide/trainer/gloo_groups.py: which groups share the world's gloo context and which form their
own (over a store of their own). In process, over a recorded ``_new_process_group_impl``; the 3-rank jobs of
tests/e2e/test_sharded.py run it for real."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import paddle.distributed as dist
import pytest
from paddle.base import core
from paddle.distributed import collective

from tide.trainer import distenv
from tide.trainer.gloo_groups import share_world_context

pytestmark = pytest.mark.unit

WORLD_PG = object()


@pytest.fixture
def formed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The groups that formed a context of their own: (backend, size)."""
    calls: list[tuple[str, int]] = []

    def original(backend: str, store: Any, rank: int, size: int, name: str, *a: Any) -> Any:
        calls.append((backend, size))
        return object()

    monkeypatch.setattr(collective, "_new_process_group_impl", original)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(
        collective,
        "_get_default_group",
        lambda: SimpleNamespace(nranks=3, process_group=WORLD_PG),
    )
    return calls


def test_a_gloo_group_of_the_whole_world_shares_the_default_context(
    formed: list[tuple[str, int]],
) -> None:
    share_world_context()
    share_world_context()  # a second call does not wrap twice
    impl = collective._new_process_group_impl
    assert impl("gloo", None, 1, 3, "sharding", None) is WORLD_PG
    assert formed == []


class _Store:
    """The default group's store: what set puts, get reads."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> list[int]:
        return list(self.kv[key])


def test_other_groups_form_their_own(
    formed: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    stores: list[tuple[str, int, bool, int]] = []
    monkeypatch.setattr(
        core,
        "TCPStore",
        lambda host, port, master, n, timeout: stores.append((host, port, master, n)),
    )
    waited: list[str] = []
    monkeypatch.setattr(distenv, "wait_for_port", lambda address, timeout: waited.append(address))
    share_world_context()
    impl = collective._new_process_group_impl
    default = _Store()
    # A subgroup's rank 0 serves a store of its own and publishes where; its rank 1 reads it.
    assert impl("gloo", default, 0, 2, "pair", None) is not WORLD_PG
    assert impl("gloo", default, 1, 2, "pair", None) is not WORLD_PG
    assert impl("nccl", None, 0, 3, "world-on-gpu", None) is not WORLD_PG
    assert formed == [("gloo", 2), ("gloo", 2), ("nccl", 3)]
    (host, port, master, n), (host1, port1, master1, n1) = stores
    # No worker count: Paddle's wait for it costs 90 ms a store; gloo's rendezvous waits anyway.
    assert (master, n, master1, n1) == (True, 0, False, 0)
    assert (host1, port1) == (host, port)
    assert default.kv["/tide/gloo_store/pair"] == f"{host}:{port}".encode()
    # The member connects once the server listens (Paddle's client sleeps 3 s otherwise).
    assert waited == [f"{host}:{port}"]
