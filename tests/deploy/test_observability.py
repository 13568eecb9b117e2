"""deploy/observability for real: promtool on the alerts and their unit tests, and a real
Prometheus scraping running Tide services while every dashboard query is asked of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from tests.scaler.support import report
from tests.support.chart import PRODUCTION, render
from tests.support.poll import eventually
from tests.support.procs import ROOT, ServiceProcess, start_memory_scaler, start_service
from tests.support.prom import binary, running_prometheus
from tide.base.client import open_channel
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.integration

OBS = ROOT / "deploy" / "observability"
RULES = OBS / "tide.rules.yaml"
DASHBOARD = OBS / "grafana-dashboard.json"

#: Dashboard queries that may rightly return nothing here, and why.
MAY_BE_EMPTY = {
    # The test's job lives in the in-memory coordinator; the real one has no job, so
    # its per-job series do not exist (they appear, at 0, when it installs a job).
    'sum by (job_id) (increase(tide_coordinator_lost_steps_total{job_id=~".*"}[1h]))',
    # Exists only while a decision is not final; the in-memory coordinator ends them at once.
    'time() - tide_scaler_job_active_decision_created_timestamp_seconds{job_id=~".*"}',
}


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = binary("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [promtool, "test", "rules", str(OBS / "tests" / "tide.rules.test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # Every alert has a unit test that shows it firing.
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = yaml.safe_load((OBS / "tests" / "tide.rules.test.yaml").read_text())
    fired = {
        a["alertname"] for t in tested["tests"] for a in t["alert_rule_test"] if a.get("exp_alerts")
    }
    assert alerts == fired


def test_generated_files_match_their_source() -> None:
    r = subprocess.run(
        [sys.executable, "scripts/gen_observability.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cr = yaml.safe_load((OBS / "prometheusrule.yaml").read_text())
    assert cr["kind"] == "PrometheusRule"
    source = yaml.safe_load(RULES.read_text())
    for group in source["groups"]:
        for rule in group["rules"]:
            notes = rule["annotations"]
            if "runbook" in notes:
                notes["runbook_url"] = (
                    "https://github.com/tide-project/tide/blob/main/" + (notes["runbook"])
                )
    assert cr["spec"] == source
    # The chart ships the same rules and dashboard, with selectable labels.
    chart = render(PRODUCTION, sets={"prometheusRule.runbookBaseURL": "https://docs.example/"})
    (rule,) = chart.all("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    urls = [r["annotations"].get("runbook_url") for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "https://docs.example/docs/install.md" in urls
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"TideScalerDown", "TideCoordinatorDown"} <= alerts
    assert len(alerts) == sum(len(g["rules"]) for g in source["groups"])
    board = chart.one("ConfigMap", "tide-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["tide.json"]) == json.loads(DASHBOARD.read_text())


def _dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in doc["annotations"]["list"]]
    return exprs


def test_every_metric_in_the_rules_and_the_dashboard_is_documented() -> None:
    docs = (ROOT / "docs" / "observability.md").read_text()
    text = RULES.read_text() + "\n".join(_dashboard_exprs())
    names = set(re.findall(r"\b((?:tide|grpc)_[a-z_]+?)(?:_bucket|_count|_sum)?\b", text))
    missing = sorted(n for n in names if f"`{n}`" not in docs)
    assert missing == []
    # And every alert is named in the docs next to what it watches.
    for g in yaml.safe_load(RULES.read_text())["groups"]:
        for r in g["rules"]:
            assert r["alert"] in docs, r["alert"]


def _grafana_to_promql(expr: str) -> str:
    """What Grafana sends for the dashboard's variables: all jobs, a short rate window."""
    return expr.replace("$job_id", ".*").replace("$__rate_interval", "10s")


async def _feed(target: str, stop: asyncio.Event) -> None:
    """Telemetry of job ml/a's two pods (4 GPUs each) at 95 %: it grows."""
    async with open_channel(target) as channel:
        stub = telemetry_pb2_grpc.TelemetryStub(channel)
        queue: asyncio.Queue[telemetry_pb2.NodeReport | None] = asyncio.Queue()

        async def reports() -> AsyncIterator[telemetry_pb2.NodeReport]:
            while (r := await queue.get()) is not None:
                yield r

        call = stub.Stream(reports())
        drain = asyncio.create_task(_drain(call))
        seq = 1
        pods = ["uid-a-0"] * 4 + ["uid-a-1"] * 4 + ["uid-a-2"] * 4 + ["uid-a-3"] * 4
        while not stop.is_set():
            await queue.put(report("gpu-node-1", seq, utils=[95.0] * 16, pods=pods, capacity=16))
            seq += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
        await queue.put(None)
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await drain


async def _drain(call: Any) -> None:
    async for _ack in call:
        pass


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_prometheus_scrapes_the_services_and_the_dashboard_queries_return_series(
    tmp_path: Path,
) -> None:
    db = f"sqlite:///{tmp_path / 'tide.db'}"
    procs: list[ServiceProcess] = []
    stop = asyncio.Event()
    feeder: asyncio.Task[None] | None = None
    try:
        coordinator = start_service(
            [
                "-m",
                "tide.services.coordinator",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--db",
                f"sqlite:///{tmp_path / 'coordinator.db'}",
            ]
        )
        procs.append(coordinator)
        scaler = start_memory_scaler(
            db,
            *[
                "--metrics-listen",
                "127.0.0.1:0",
                "--bucket-s",
                "1",
                "--sustain-s",
                "2",
                "--cooldown-s",
                "0",
                "--scale-down-stabilization-s",
                "0",
                "--evaluate-interval-s",
                "0.5",
                "--total-gpus",
                "64",
            ],
        )
        procs.append(scaler)
        agent = start_service(
            [
                "-m",
                "tide.services.agent",
                "--scaler",
                scaler.target,
                "--node-name",
                "synthetic-1",
                "--source",
                "synthetic",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--no-watch-node",
            ]
        )
        procs.append(agent)
        scrape = {
            name: [f"127.0.0.1:{p.metrics_port}"]
            for name, p in (("scaler", scaler), ("coordinator", coordinator), ("agent", agent))
        }
        with running_prometheus(tmp_path / "prom", scrape) as prom:
            await eventually(
                lambda: len(prom.targets_up()) == 3, timeout_s=30, what="all targets up"
            )
            # The job starts once Prometheus watches, so the annotations see its decisions.
            async with open_channel(scaler.target) as channel:
                stub = scaler_pb2_grpc.ScalerStub(channel)
                await stub.UpsertJob(
                    scaler_pb2.UpsertJobRequest(
                        job_id="ml/a",
                        policy=scaler_pb2.Policy(min_replicas=2, max_replicas=4),
                        initial_replicas=2,
                        gpus_per_replica=4,
                    ),
                    timeout=10,
                )
            feeder = asyncio.create_task(_feed(scaler.target, stop))
            # The job grew 2 -> 4 on the sustained 95 %.
            await eventually(
                lambda: prom.query('tide_scaler_job_replicas{job_id="ml/a"} == 4'),
                timeout_s=60,
                what="ml/a at 4 replicas in prometheus",
            )
            pending = {_grafana_to_promql(e) for e in _dashboard_exprs()}
            empty: set[str] = set()
            deadline = time.monotonic() + 30
            while pending and time.monotonic() < deadline:
                empty = {q for q in pending if not prom.query(q)}
                pending = empty
                if pending:
                    await asyncio.sleep(1)
            assert empty - MAY_BE_EMPTY == set()
            builds = {r["metric"]["service"] for r in prom.query("tide_build_info")}
            assert builds == {"scaler", "coordinator", "agent"}
    finally:
        stop.set()
        if feeder is not None:
            with contextlib.suppress(Exception):
                await feeder
        for p in reversed(procs):
            p.kill()
