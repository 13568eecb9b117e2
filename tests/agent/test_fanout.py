"""--scaler-fanout: the agent streams the same reports to every scaler replica its
--scaler name resolves to, each replica with its own numbering, against real grpc.aio
servers on port 0 (the resolver is a test's: one DNS name cannot hold two ports)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tide.v1 import telemetry_pb2

from services.agent.fanout import resolve_addresses
from services.agent.settings import AgentSettings
from tests.support.poll import eventually

from .support import RunAgent, Scaler, agent_settings, start_scaler

pytestmark = pytest.mark.component


class Dns:
    """What the resolver answers now: addresses, or an error."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: OSError | None = None
        self.asked = 0

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


def _settings(**kw: object) -> AgentSettings:
    return agent_settings(
        50051,
        scaler="tide-scaler-peers.tide.svc:50051",
        scaler_fanout=True,
        scaler_resolve_interval_s=0.1,
        **kw,
    )


def _contiguous_from_1(seqs: list[int]) -> bool:
    return seqs == list(range(1, len(seqs) + 1))


async def test_every_replica_gets_every_report_with_its_own_numbers(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    dns = Dns(f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
    r = await run_agent(_settings(), resolver=dns)
    boot = r.agent.boot_id
    await eventually(
        lambda: min(len(a.recorder.seqs(boot)), len(b.recorder.seqs(boot))) >= 10,
        what="10 reports each",
    )
    assert r.agent.metrics.scaler_replicas._value.get() == 2
    await eventually(
        lambda: r.agent.metrics.scaler_replicas_connected._value.get() == 2, what="both up"
    )
    await r.shutdown()
    for s in (a, b):
        assert _contiguous_from_1(s.recorder.seqs(boot)), s.recorder.seqs(boot)
        assert s.recorder.duplicates == 0
        last = s.recorder.received[-1]
        assert [e.kind for e in last.events] == [telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN]
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
    dns = Dns(f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
    r = await run_agent(_settings(), resolver=dns)
    boot = r.agent.boot_id
    await eventually(lambda: len(b.recorder.seqs(boot)) >= 5, what="b's first reports")
    dns.addresses = [f"127.0.0.1:{a.port}"]
    await eventually(lambda: len(r.agent.fanout.replicas) == 1, what="b dropped")  # type: ignore[union-attr]
    b_then, a_then = len(b.recorder.received), len(a.recorder.received)
    await eventually(lambda: len(a.recorder.received) >= a_then + 10, what="a goes on")
    # b's stream was closed, so nothing more reached it (one report may have been in transit).
    assert len(b.recorder.received) <= b_then + 1
    dns.addresses = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    await eventually(lambda: len(b.recorder.received) >= b_then + 5, what="b is back")
    await r.shutdown()
    # No restart at 1 and no hole: a scaler acks the highest contiguous number only.
    seqs = sorted(set(b.recorder.seqs(boot)))
    assert seqs == list(range(1, len(seqs) + 1))
    assert b.recorder.boots[boot].acked == seqs[-1]


async def test_a_replica_away_holds_nothing_back_for_the_others(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    await b.server.stop(None)
    dns = Dns(f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
    r = await run_agent(_settings(shutdown_flush_s=0.5), resolver=dns)
    boot = r.agent.boot_id
    await eventually(lambda: len(a.recorder.seqs(boot)) >= 10, what="a's reports")
    assert r.agent.buffer.added_total == 0  # the single-stream buffer is not used
    fan = r.agent.fanout
    assert fan is not None
    assert len(fan.replicas[f"127.0.0.1:{a.port}"].buffer) <= 3  # acked as they come
    assert len(fan.replicas[f"127.0.0.1:{b.port}"].buffer) >= 10  # held for b
    assert r.agent.metrics.scaler_replicas_connected._value.get() == 1
    await r.shutdown()
    assert [e.kind for e in a.recorder.received[-1].events] == [
        telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN
    ]


async def test_a_failing_resolver_keeps_the_replicas_known(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    dns = Dns(f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
    r = await run_agent(_settings(), resolver=dns)
    boot = r.agent.boot_id
    await eventually(lambda: len(b.recorder.seqs(boot)) >= 3, what="b's first reports")
    dns.error = OSError("Temporary failure in name resolution")
    asked = dns.asked
    await eventually(lambda: dns.asked >= asked + 3, what="resolved again, failing")
    b_then = len(b.recorder.received)
    await eventually(lambda: len(b.recorder.received) >= b_then + 5, what="b goes on")
    dns.error, dns.addresses = None, []  # an empty answer keeps them too
    await eventually(lambda: dns.asked >= asked + 6, what="resolved again, empty")
    assert len(r.agent.fanout.replicas) == 2  # type: ignore[union-attr]
    await r.shutdown()


async def test_resolving_a_name_gives_every_address_with_the_port() -> None:
    assert "127.0.0.1:50051" in await resolve_addresses("localhost:50051")
    assert await resolve_addresses("127.0.0.1:7") == ["127.0.0.1:7"]
    assert await resolve_addresses("[::1]:7") == ["[::1]:7"]


async def test_reports_sampled_before_the_first_answer_reach_every_replica(
    replicas: tuple[Scaler, Scaler], run_agent: RunAgent
) -> None:
    a, b = replicas
    dns = Dns()  # nobody yet: a rollout, or DNS not ready at the agent's start
    r = await run_agent(_settings(), resolver=dns)
    boot = r.agent.boot_id
    await eventually(lambda: r.agent.metrics.reports_sampled._value.get() >= 5, what="samples")
    assert not a.recorder.received and not b.recorder.received
    dns.addresses = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    await eventually(
        lambda: min(len(a.recorder.seqs(boot)), len(b.recorder.seqs(boot))) >= 10,
        what="both replicas",
    )
    await r.shutdown()
    sampled = int(r.agent.metrics.reports_sampled._value.get())
    for s in (a, b):
        # Every report sampled, the early ones included, reached each replica (a resend
        # after a reconnect carries a number already seen).
        assert sorted(set(s.recorder.seqs(boot))) == list(range(1, sampled + 1))
