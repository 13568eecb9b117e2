"""Prometheus and promtool from Debian's package, for the tests of deploy/observability.

``make test`` installs them (scripts/ensure_prometheus.sh); elsewhere a missing
binary is a skip, and under ``make test`` (TIDE_TEST_STRICT) a failure. A test's
Prometheus runs on a free port with its own config and data dir, never the
package's service or port 9090.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.poll import wait_for
from tide.services.testing.ports import free_port


def binary(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; skip (or fail under make test) if absent."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} not installed (scripts/ensure_prometheus.sh installs Debian's prometheus)"
    if os.environ.get("TIDE_TEST_STRICT"):
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Prometheus:
    url: str

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result

    def targets_up(self) -> list[str]:
        active = self.get("/api/v1/targets")["activeTargets"]
        return [t["scrapePool"] for t in active if t["health"] == "up"]


@contextmanager
def running_prometheus(
    tmp: Path, scrape: dict[str, Sequence[str]], *, interval_s: float = 1.0
) -> Iterator[Prometheus]:
    """Prometheus scraping ``scrape`` (job name -> HOST:PORT targets) every ``interval_s``."""
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in scrape.items()
        ],
    }
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config))
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    try:
        wait_for(ready, timeout_s=60, what="prometheus ready")
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
