"""Scaler replica to scaler replica: partial aggregates shipped to the job's owner.

:class:`PeerLink` is the side effect (one call per owner and shipment);
:class:`GrpcPeerLink` is its one real implementation, the ``tide.v1.ScalerPeers``
service (tide/v1/peers.proto) with the credentials the scaler presents to
the coordinator (its scaler certificate, or token), a channel per owner address
kept while that owner is live. tide/services/testing/shards.py has the in-process one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import grpc

from tide.base.client import domain_error, open_channel
from tide.base.credentials import ClientCredentials
from tide.services.scaler.partials import JobPartial, NodeNotice
from tide.v1 import peers_pb2, peers_pb2_grpc

logger = logging.getLogger(__name__)


class PeerLink(Protocol):
    async def ship(
        self,
        address: str,
        sender: str,
        parts: Sequence[JobPartial],
        notices: Sequence[NodeNotice] = (),
        *,
        timeout_s: float,
    ) -> tuple[int, int]:
        """Ship ``parts`` and ``notices`` to the replica at ``address``; returns (bytes
        sent, parts it refused). Raises a TideError when it does not answer within
        ``timeout_s``."""
        ...

    def keep(self, addresses: Iterable[str]) -> None:
        """Only these owners are live: anything held for another may go."""
        ...

    async def close(self) -> None: ...


def partial_to_proto(p: JobPartial) -> peers_pb2.JobPartial:
    return peers_pb2.JobPartial(
        job_id=p.job_id,
        bucket_s=p.bucket_s,
        buckets=p.buckets,
        slots=[
            peers_pb2.PartialSlot(
                slot=k,
                sum_pct=v[0],
                samples=int(v[1]),
                gpm_samples=int(v[2]) if len(v) > 2 else 0,
                sm_active_sum_pct=v[3] if len(v) > 2 else 0.0,
                tensor_active_sum_pct=v[4] if len(v) > 2 else 0.0,
            )
            for k, v in p.slots.items()
        ],
        seconds=[
            peers_pb2.PartialSecond(
                second=k, sum_pct=v[0], samples=int(v[1]), min_pct=v[2], max_pct=v[3]
            )
            for k, v in p.seconds.items()
        ],
        seen=[
            peers_pb2.GpuSeen(node_name=node, index=i, sampled_at_s=t)
            for (node, i), t in p.seen_s.items()
        ],
    )


def partial_from_proto(m: peers_pb2.JobPartial) -> JobPartial:
    return JobPartial(
        m.job_id,
        m.bucket_s,
        m.buckets,
        slots={
            s.slot: [
                s.sum_pct,
                float(s.samples),
                float(s.gpm_samples),
                s.sm_active_sum_pct,
                s.tensor_active_sum_pct,
            ]
            for s in m.slots
        },
        seconds={s.second: [s.sum_pct, float(s.samples), s.min_pct, s.max_pct] for s in m.seconds},
        seen_s={(g.node_name, g.index): g.sampled_at_s for g in m.seen},
    )


def notice_to_proto(n: NodeNotice) -> peers_pb2.NodeNotice:
    return peers_pb2.NodeNotice(
        job_id=n.job_id,
        node_name=n.node,
        kind=n.kind,  # type: ignore[arg-type]
        deadline_s=n.deadline_s or 0.0,
        pods=sorted(n.pods),
    )


def notice_from_proto(m: peers_pb2.NodeNotice) -> NodeNotice:
    return NodeNotice(m.job_id, m.node_name, m.kind, m.deadline_s or None, frozenset(m.pods))


def ship_request(
    sender: str, parts: Sequence[JobPartial], notices: Sequence[NodeNotice]
) -> peers_pb2.ShipPartialsRequest:
    # An uncordon travels apart: a replica that predates ``withdrawn`` would read one
    # among the notices as a cordon and shrink the job off a node that is back.
    return peers_pb2.ShipPartialsRequest(
        sender=sender,
        jobs=[partial_to_proto(p) for p in parts],
        notices=[notice_to_proto(n) for n in notices if not n.withdrawn],
        withdrawn=[notice_to_proto(n) for n in notices if n.withdrawn],
    )


class GrpcPeerLink:
    def __init__(self, credentials: ClientCredentials, *, tls_server_name: str = "") -> None:
        self.credentials = credentials
        # Replicas are dialled by pod IP; their certificate names the Service.
        self._options = (
            {"grpc.ssl_target_name_override": tls_server_name} if tls_server_name else None
        )
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> Any:  # grpc-stubs types the aio stub as sync
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(
                address, credentials=self.credentials, extra_options=self._options
            )
        return peers_pb2_grpc.ScalerPeersStub(ch)

    async def ship(
        self,
        address: str,
        sender: str,
        parts: Sequence[JobPartial],
        notices: Sequence[NodeNotice] = (),
        *,
        timeout_s: float,
    ) -> tuple[int, int]:
        req = ship_request(sender, parts, notices)
        try:
            resp = await self._stub(address).ShipPartials(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None
        return req.ByteSize(), resp.refused

    def keep(self, addresses: Iterable[str]) -> None:
        live = set(addresses)
        for address in [a for a in self._channels if a not in live]:
            ch = self._channels.pop(address)
            task = asyncio.ensure_future(ch.close())
            task.add_done_callback(_log_close)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            with contextlib.suppress(Exception):
                await ch.close()


def _log_close(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("peer channel close failed: %s", task.exception())
