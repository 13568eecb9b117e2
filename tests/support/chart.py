"""The Helm chart (deploy/helm/tide) rendered by the real `helm template`, for the
manifest tests: objects by kind and name, the pod templates, label selectors.

`helm` comes from tests/support/kubetools.py. Renders are cached per set of
inputs: the chart does not change during a test run.
"""

from __future__ import annotations

import copy
import functools
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubetools import kubetools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tide"
SMALL = ROOT / "deploy" / "helm" / "values-small.yaml"
PRODUCTION = ROOT / "deploy" / "helm" / "values-production.yaml"
#: The example values files, by the name tests show.
EXAMPLES = {"small": SMALL, "production": PRODUCTION}
#: The oldest Kubernetes the chart supports (Chart.yaml kubeVersion), and the
#: kubectl of tests/support/kubetools.py.
KUBE_VERSIONS = ("1.27.0", "1.35.0")
NAMESPACE = "tide-system"
RELEASE = "tide"


class HelmFailed(Exception):
    """`helm` exited non-zero; the message is its stderr."""


def helm(*args: str | Path) -> str:
    """Run helm; its stdout, or HelmFailed with its stderr."""
    done = subprocess.run(
        [str(kubetools().helm), *map(str, args)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise HelmFailed(done.stderr.strip())
    return done.stdout


def template_args(
    values: Sequence[Path] = (),
    sets: Mapping[str, str] | None = None,
    *,
    chart: Path = CHART,
    kube_version: str = KUBE_VERSIONS[-1],
) -> list[str | Path]:
    args: list[str | Path] = ["template", RELEASE, chart, "-n", NAMESPACE]
    args += ["--kube-version", kube_version]
    for v in values:
        args += ["-f", v]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


@functools.cache
def _render(
    values: tuple[Path, ...], sets: tuple[tuple[str, str], ...], chart: Path, kube_version: str
) -> tuple[dict[str, Any], ...]:
    out = helm(*template_args(values, dict(sets), chart=chart, kube_version=kube_version))
    return tuple(d for d in yaml.safe_load_all(out) if d)


@dataclass(frozen=True)
class Rendered:
    """What one `helm template` produced."""

    objects: tuple[dict[str, Any], ...]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (obj,) = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        return obj

    def workloads(self) -> list[dict[str, Any]]:
        """Every object with a pod template."""
        return [o for o in self.objects if o["kind"] in ("Deployment", "DaemonSet", "Job")]

    def pod(self, kind: str, name: str) -> dict[str, Any]:
        """The pod spec of a workload."""
        return dict(self.one(kind, name)["spec"]["template"]["spec"])


def render(
    *values: Path,
    sets: Mapping[str, str] | None = None,
    chart: Path = CHART,
    kube_version: str = KUBE_VERSIONS[-1],
) -> Rendered:
    """`helm template` of the chart with these values files and --set pairs."""
    key = tuple(sorted((sets or {}).items()))
    # A copy: tests may edit what they get, and the cache must not see it.
    return Rendered(copy.deepcopy(_render(tuple(values), key, chart, kube_version)))


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects ``labels``."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
