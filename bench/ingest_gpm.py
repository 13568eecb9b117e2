"""What the GPM fields cost the ingest: the same reports with and without the GPM
activity of every GPU (tide.v1.GpuSample's four fields, as the agent sends them:
all four), parsed and applied by one Ingest, in one process, rounds alternating so
that both see the same machine load. Read by bench.ingest
(``ingest_cost_ratio_with_gpm``); alone: ``python -m bench.ingest_gpm``.
"""

from __future__ import annotations

import json
import time

from tide.base.timeconv import ts_from_seconds
from tide.services.scaler.ingest import Ingest, IngestSettings, StreamState
from tide.services.scaler.members import Member
from tide.services.testing.clock import FakeClock
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import common_pb2, telemetry_pb2

T0 = 1_800_000_000.0
GPUS = 8
NODES = 32  # 4 nodes (two pods of 4 GPUs each) per job


def _reports(n: int, gpm: bool) -> list[bytes]:
    out = []
    for k in range(n):
        node = k % NODES
        r = telemetry_pb2.NodeReport(
            node_name=f"n{node}",
            boot_id="b",
            seq=k // NODES + 1,
            gpu_capacity=GPUS,
            sampled_at=ts_from_seconds(T0 + 0.1 * (k // NODES)),
        )
        for i in range(GPUS):
            pod = f"j{node // 4}-p{(node % 4) * 2 + i // 4}"
            g = r.gpus.add(
                index=i,
                uuid=f"GPU-{node}-{i}",
                utilization_pct=50.0 + (k + i) % 40,
                memory_used_bytes=1 << 30,
                memory_total_bytes=80 << 30,
                power_w=400.0,
                temperature_c=60.0,
                pod=common_pb2.PodRef(namespace="ns", name=pod, uid=pod),
            )
            if gpm:
                g.sm_active_pct = 30.0 + i
                g.sm_occupancy_pct = 20.0
                g.tensor_active_pct = 10.0 + i
                g.dram_active_pct = 40.0
        out.append(r.SerializeToString())
    return out


def _engine() -> Ingest:
    reg = InMemoryMemberRegistry()
    for j in range(NODES // 4):
        reg.set_members(f"ns/j{j}", [Member(f"j{j}-p{i}", f"j{j}-p{i}") for i in range(8)])
    return Ingest(IngestSettings(), reg, FakeClock(T0 + 20.0))


def _run(wire: list[bytes]) -> float:
    ing = _engine()
    streams: dict[str, StreamState] = {}
    parse = telemetry_pb2.NodeReport.FromString
    # CPU time of this thread: on a shared machine, wall time counts the other
    # processes' turns too.
    t = time.thread_time()
    for b in wire:
        r = parse(b)
        st = streams.get(r.node_name)
        if st is None:
            st = streams[r.node_name] = ing.open_stream()
        ing.process(st, r)
    took = time.thread_time() - t
    # A benchmark of dropped reports would measure nothing: every sample must land.
    if ing.samples_accepted != len(wire) * GPUS or ing.samples_unattributed:
        raise RuntimeError(f"bench: {ing.samples_accepted} of {len(wire) * GPUS} samples landed")
    return took


def gpm_cost_ratio(reports: int = 2000, rounds: int = 15) -> dict[str, float]:
    """Seconds per report with and without GPM (the best of ``rounds`` each) and the
    ratio: what the parse and Ingest.process pay for the new fields."""
    plain, with_gpm = _reports(reports, False), _reports(reports, True)
    best_plain = best_gpm = float("inf")
    for _ in range(rounds):
        best_plain = min(best_plain, _run(plain))
        best_gpm = min(best_gpm, _run(with_gpm))
    return {
        "ingest_us_per_report": round(best_plain / reports * 1e6, 2),
        "ingest_us_per_report_with_gpm": round(best_gpm / reports * 1e6, 2),
        "ingest_cost_ratio_with_gpm": round(best_gpm / best_plain, 3),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(gpm_cost_ratio()))
