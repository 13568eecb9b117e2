"""Turns a Sample (plain values) into the NodeReport the scaler reads."""

from __future__ import annotations

from tide.base.timeconv import ts_from_seconds
from tide.v1 import common_pb2, telemetry_pb2

from .attribution import owner_of
from .model import NodeNotice, PodOwner, Sample

_KINDS = {
    "CORDONED": telemetry_pb2.NodeEvent.KIND_CORDONED,
    "UNCORDONED": telemetry_pb2.NodeEvent.KIND_UNCORDONED,
    "TERMINATION_NOTICE": telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE,
    "AGENT_SHUTDOWN": telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN,
}


def node_event(notice: NodeNotice) -> telemetry_pb2.NodeEvent:
    return telemetry_pb2.NodeEvent(
        kind=_KINDS[notice.kind.name],
        detail=notice.detail,
        observed_at=ts_from_seconds(notice.observed_at),
        # Unset when the node gave no deadline: unknown, not the epoch.
        deadline=ts_from_seconds(notice.deadline),
    )


def _pct(x: float) -> float:
    # GPM computes its percentages from counters over an interval; rounding can
    # put one a hair outside 0..100, which the scaler would reject.
    return min(100.0, max(0.0, x))


def build_report(
    sample: Sample, node_name: str, boot_id: str, owners: dict[str, PodOwner]
) -> telemetry_pb2.NodeReport:
    """The report without its seq: the buffer numbers it when it is first sent."""
    report = telemetry_pb2.NodeReport(
        node_name=node_name,
        boot_id=boot_id,
        gpu_capacity=sample.gpu_capacity,
        sampled_at=ts_from_seconds(sample.sampled_at),
    )
    for r in sample.gpus:
        gpu = report.gpus.add(
            index=r.index,
            uuid=r.uuid,
            # Clamp what a driver may report out of range, so one odd reading
            # cannot make the scaler reject the whole report.
            utilization_pct=min(100.0, max(0.0, r.utilization_pct)),
            memory_used_bytes=min(r.memory_used_bytes, r.memory_total_bytes),
            memory_total_bytes=r.memory_total_bytes,
            power_w=max(0.0, r.power_w),
            temperature_c=r.temperature_c,
            health_flags=int(r.health),
        )
        if r.gpm is not None:
            # A field left unset reads NaN at the scaler: "not measured", never 0.
            a = r.gpm
            if a.sm_active_pct is not None:
                gpu.sm_active_pct = _pct(a.sm_active_pct)
            if a.sm_occupancy_pct is not None:
                gpu.sm_occupancy_pct = _pct(a.sm_occupancy_pct)
            if a.tensor_active_pct is not None:
                gpu.tensor_active_pct = _pct(a.tensor_active_pct)
            if a.dram_active_pct is not None:
                gpu.dram_active_pct = _pct(a.dram_active_pct)
        owner = owner_of(owners, r)
        if owner is not None:
            gpu.pod.CopyFrom(
                common_pb2.PodRef(namespace=owner.namespace, name=owner.name, uid=owner.uid)
            )
    report.events.extend(node_event(n) for n in sample.notices)
    return report
