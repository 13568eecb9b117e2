"""--scaler-fanout: the agent streams the same reports to every scaler replica its
--scaler name resolves to, each replica with its own numbering, against real grpc.aio
servers on port 0 (the resolver is a test's: one DNS name cannot hold two ports)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.poll import eventually
from tide.services.agent.fanout import resolve_addresses
from tide.v1 import telemetry_pb2

from .support import RunAgent, Running, Scaler, agent_settings, fanout, start_scaler

pytestmark = pytest.mark.component


def _address(s: Scaler) -> str:
    return f"127.0.0.1:{s.port}"


class Dns:
    """What the resolver answers now: the addresses of some replicas, or an error."""

    def __init__(self, *replicas: Scaler) -> None:
        self.point_at(*replicas)
        self.error: OSError | None = None
        self.asked = 0

    def point_at(self, *replicas: Scaler) -> None:
        self.addresses = [_address(s) for s in replicas]

    async def __call__(self, target: str) -> list[str]:
        assert target == "tide-scaler-peers.tide.svc:50051"
        self.asked += 1
        if self.error is not None:
            raise self.error
        return list(self.addresses)


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[Scaler, Scaler]]:
    a, b = await start_scaler(), await start_scaler()
    yield a, b
    for s in (a, b):
        await s.server.stop(None)


async def _run(run_agent: RunAgent, *replicas: Scaler, **kw: object) -> tuple[Running, str, Dns]:
    """An agent fanning out to what its resolver answers, at first ``replicas``; with its
    boot id and the resolver, to change the answer."""
    dns = Dns(*replicas)
    settings = agent_settings(
        50051,
        scaler="tide-scaler-peers.tide.svc:50051",
        scaler_fanout=True,
        scaler_resolve_interval_s=0.1,
        **kw,
    )
    r = await run_agent(settings, resolver=dns)
    return r, r.agent.boot_id, dns


async def _each_gets(boot: str, count: int, *replicas: Scaler) -> None:
    await eventually(
        lambda: min(len(s.recorder.seqs(boot)) for s in replicas) >= count,
        what=f"{count} reports at each of {len(replicas)} replicas",
    )


async def _gets_more(s: Scaler, count: int, what: str) -> None:
    then = len(s.recorder.received)
    await eventually(lambda: len(s.recorder.received) >= then + count, what=what)


def _numbered_from_1(s: Scaler, boot: str) -> list[int]:
    """The numbers ``s`` got from ``boot``, once each: from 1, with no hole (a scaler acks
    the highest contiguous number only). A resend after a reconnect repeats one."""
    seqs = sorted(set(s.recorder.seqs(boot)))
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    return seqs


def _ends_with_shutdown(s: Scaler) -> bool:
    last = s.recorder.received[-1]
    return [e.kind for e in last.events] == [telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN]


async def test_every_replica_gets_every_report_with_its_own_numbers(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    r, boot, _ = await _run(run_agent, a, b)
    await _each_gets(boot, 10, a, b)
    assert r.agent.metrics.scaler_replicas._value.get() == 2
    await eventually(
        lambda: r.agent.metrics.scaler_replicas_connected._value.get() == 2, what="both up"
    )
    await r.shutdown()
    for s in (a, b):
        # In order and never twice: nothing went wrong on these streams.
        assert s.recorder.seqs(boot) == _numbered_from_1(s, boot)
        assert s.recorder.duplicates == 0
        assert _ends_with_shutdown(s)
    # The same samples went to both: same GPUs, same times, in the same order.
    times_a = [m.sampled_at.ToNanoseconds() for m in a.recorder.received]
    times_b = [m.sampled_at.ToNanoseconds() for m in b.recorder.received]
    common = min(len(times_a), len(times_b))
    assert common >= 10
    assert times_a[-common:] == times_b[-common:]


async def test_a_replica_that_leaves_and_comes_back_resumes_its_numbers(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    r, boot, dns = await _run(run_agent, a, b)
    await _each_gets(boot, 5, b)
    dns.point_at(a)
    await eventually(lambda: len(fanout(r.agent).replicas) == 1, what="b dropped")
    b_then = len(b.recorder.received)
    await _gets_more(a, 10, what="a goes on")
    # b's stream was closed, so nothing more reached it (one report may have been in transit).
    assert len(b.recorder.received) <= b_then + 1
    dns.point_at(a, b)
    await _gets_more(b, 5, what="b is back")
    await r.shutdown()
    # No restart at 1 and no hole, and b acked them all.
    assert b.recorder.boots[boot].acked == _numbered_from_1(b, boot)[-1]


async def test_a_replica_away_holds_nothing_back_for_the_others(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    await b.server.stop(None)
    r, boot, _ = await _run(run_agent, a, b, shutdown_flush_s=0.5)
    await _each_gets(boot, 10, a)
    fan = fanout(r.agent)  # and so no single-stream buffer was built beside it
    assert len(fan.replicas[_address(a)].buffer) <= 3  # acked as they come
    assert len(fan.replicas[_address(b)].buffer) >= 10  # held for b
    assert r.agent.metrics.scaler_replicas_connected._value.get() == 1
    await r.shutdown()
    assert _ends_with_shutdown(a)


async def test_a_failing_resolver_keeps_the_replicas_known(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    r, boot, dns = await _run(run_agent, a, b)
    await _each_gets(boot, 3, b)
    dns.error = OSError("Temporary failure in name resolution")
    asked = dns.asked
    await eventually(lambda: dns.asked >= asked + 3, what="resolved again, failing")
    await _gets_more(b, 5, what="b goes on")
    dns.error = None
    dns.point_at()  # an empty answer keeps them too
    await eventually(lambda: dns.asked >= asked + 6, what="resolved again, empty")
    assert len(fanout(r.agent).replicas) == 2
    await r.shutdown()


async def test_resolving_a_name_gives_every_address_with_the_port() -> None:
    assert "127.0.0.1:50051" in await resolve_addresses("localhost:50051")
    assert await resolve_addresses("127.0.0.1:7") == ["127.0.0.1:7"]
    assert await resolve_addresses("[::1]:7") == ["[::1]:7"]


async def test_reports_sampled_before_the_first_answer_reach_every_replica(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    # Nobody in the first answers: a rollout, or DNS not ready at the agent's start.
    r, boot, dns = await _run(run_agent)
    await eventually(lambda: r.agent.metrics.reports_sampled._value.get() >= 5, what="samples")
    assert not a.recorder.received and not b.recorder.received
    dns.point_at(a, b)
    await _each_gets(boot, 10, a, b)
    await r.shutdown()
    sampled = int(r.agent.metrics.reports_sampled._value.get())
    for s in (a, b):
        # Every report sampled, the early ones included, reached each replica.
        assert _numbered_from_1(s, boot)[-1] == sampled
