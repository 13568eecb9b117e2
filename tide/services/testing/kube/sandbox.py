"""A pod's sandbox for the stand-in kubelet (``KubeletStandIn(sandbox=...)``): the
container runs with its volumes at their real mount paths and its cluster DNS names
resolvable, so the chart's rendered commands run unchanged.

How, on Linux, as root (or where unprivileged user namespaces let ``unshare`` map root):

- a mount namespace (``unshare --mount``) whose root is an overlay of the host's ``/``
  (the image: this machine's files, copy-on-write into the pod's ``layer/u``, so
  nothing a pod writes outside its volumes reaches the host, and what it wrote can be
  read after), with ``/proc``, ``/sys`` and ``/dev`` bound in, entered
  with ``chroot``;
- each volume a directory under the pod's directory, bound at its ``mountPath``:
  ``configMap`` and ``secret`` (``items`` honoured, Secrets decoded), ``projected``
  (configMap, secret and ``serviceAccountToken`` sources), ``emptyDir``, ``hostPath``
  (under the node's directory), ``persistentVolumeClaim`` (one directory per claim,
  kept across pods: the default StorageClass);
- the ServiceAccount's token, the cluster CA and the namespace at
  /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT, as
  the kubelet mounts them unless ``automountServiceAccountToken: false``: the
  kubernetes client's in-cluster configuration finds the emulator there;
- ``/etc/hosts``: every Service as ``NAME``, ``NAME.NS``, ``NAME.NS.svc`` and
  ``NAME.NS.svc.cluster.local`` → the IP of a live pod it selects (cluster DNS with
  the Service's port equal to the pod's), rewritten in place on every sync;
- the pod's network: its own loopback address (127.X.Y.Z) as its pod IP; a container's
  ``0.0.0.0`` or ``127.0.0.1`` in its args and env means that address (what a network
  namespace would make of them), so pods of fixed ports never collide.
- the image's Tide install (``install_paths()``: this checkout, the venv and the
  interpreter it was made from) bound read-only at their own paths over the volumes,
  and ``python`` in a command this interpreter, with the checkout first on
  ``PYTHONPATH``: what ``/opt/tide`` is to the real image. Without the binds, a
  checkout under ``/tmp`` (a CI clone) is hidden by the chart's ``/tmp`` emptyDir,
  and one on another filesystem is not in the overlay of ``/`` at all: the pod's
  ``python`` was then the system's and could not import ``tide.services``.

Env ``valueFrom``: ``fieldRef``, ``secretKeyRef``, ``configMapKeyRef``.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tide.services.testing.kube.semantics import ApiError, Obj

if TYPE_CHECKING:
    from tide.services.testing.kube.apiserver import KubeApiServer

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

#: Runs in the new mount namespace: the overlay root, the binds, then the container.
#: $1 is the pod directory, $2 the file of binds (SOURCE TARGET [ro] per line), $3 the pod's
#: hostname (its own UTS namespace); the rest is argv.
_SCRIPT = r"""
set -e
P=$1; BINDS=$2; hostname "$3"; shift 3
mkdir -p "$P/layer/u" "$P/layer/w"
mount -t overlay overlay -o "lowerdir=/,upperdir=$P/layer/u,workdir=$P/layer/w" "$P/root"
for m in proc sys dev; do mount --rbind "/$m" "$P/root/$m"; done
while read -r src dst mode; do
  [ -d "$src" ] && mkdir -p "$P/root$dst" || { mkdir -p "$(dirname "$P/root$dst")"; touch "$P/root$dst"; }
  mount --bind "$src" "$P/root$dst"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro "$P/root$dst"; fi
done < "$BINDS"
cd /
exec chroot "$P/root" "$@"
"""


#: The checkout the pods run (tide/services/testing/kube/sandbox.py is three levels down).
ROOT = Path(__file__).resolve().parents[4]


def install_paths() -> tuple[Path, ...]:
    """What every pod's image holds of this machine, parents first: the checkout, the
    venv (``sys.prefix``) and the Python it was made from (``sys.base_prefix``), by
    their real paths (a venv may be a symlink to another checkout's)."""
    paths = {ROOT, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return tuple(sorted(paths, key=lambda p: len(p.parts)))


@dataclass(frozen=True)
class Image:
    """What an image name means here: its entrypoint, and files it carries (path in
    the container → a file or directory of this machine, bound read-only)."""

    entrypoint: tuple[str, ...]
    files: Mapping[str, Path] = field(default_factory=dict)


def _t(api: KubeApiServer, plural: str):  # type: ignore[no-untyped-def]
    return api.rtype("", "v1", plural)


class Sandboxes:
    def __init__(self, api: KubeApiServer, root: Path, node: str, images: Mapping[str, Image]):
        self.api = api
        self.root = root
        self.node = node
        self.images = dict(images)
        self._net = f"127.{random.randint(10, 250)}.{random.randint(0, 255)}"
        self._next_ip = 2
        self._ips: dict[str, str] = {}  # pod uid → IP
        self._hosts: list[tuple[Path, str]] = []  # each pod's file, and its own line
        root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("unshare") is not None

    def pod_ip(self, pod: Obj) -> str:
        uid = pod["metadata"]["uid"]
        if uid not in self._ips:
            self._ips[uid] = f"{self._net}.{self._next_ip}"
            self._next_ip += 1
        return self._ips[uid]

    # -- volumes ------------------------------------------------------------------------------

    def _data(self, plural: str, ns: str, name: str, optional: bool = False) -> dict[str, bytes]:
        try:
            obj = self.api.get(_t(self.api, plural), ns, name)
        except ApiError:
            if optional:
                return {}
            raise
        if plural == "secrets":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}

    def _write(self, d: Path, data: Mapping[str, bytes], items: Sequence[Obj] | None) -> None:
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                raise ApiError(404, "NotFound", f"key {key} not found")
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data[key])

    def _token(self, pod: Obj, audience: str, ttl_s: float) -> bytes:
        meta = pod["metadata"]
        return self.api.tokens.issue(
            meta["namespace"],
            pod["spec"].get("serviceAccountName") or "default",
            audiences=(audience,),
            ttl_s=ttl_s,
            pod=meta["name"],
            pod_uid=meta["uid"],
            node=self.node,
        ).encode()

    def _volume(self, pod: Obj, vol: Obj, d: Path) -> Path:
        ns = pod["metadata"]["namespace"]
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            self.api.get(_t(self.api, "persistentvolumeclaims"), ns, claim)  # Pending without it
            d = self.root / "pvc" / ns / claim
        elif "hostPath" in vol:
            d = self.root / "node" / vol["hostPath"]["path"].lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol:
            cm = vol["configMap"]
            self._write(d, self._data("configmaps", ns, cm["name"]), cm.get("items"))
        elif "secret" in vol:
            s = vol["secret"]
            self._write(d, self._data("secrets", ns, s["secretName"]), s.get("items"))
        elif "projected" in vol:
            for src in vol["projected"].get("sources") or []:
                if "configMap" in src:
                    cm = src["configMap"]
                    self._write(d, self._data("configmaps", ns, cm["name"]), cm.get("items"))
                elif "secret" in src:
                    s = src["secret"]
                    self._write(d, self._data("secrets", ns, s["name"]), s.get("items"))
                elif "serviceAccountToken" in src:
                    t = src["serviceAccountToken"]
                    token = self._token(pod, t["audience"], float(t.get("expirationSeconds", 3600)))
                    (d / t["path"]).write_bytes(token)
        return d

    # -- the container ------------------------------------------------------------------------

    def env_from(self, pod: Obj, e: Obj) -> str | None:
        src = e.get("valueFrom") or {}
        ns = pod["metadata"]["namespace"]
        for key, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in src:
                ref = src[key]
                data = self._data(plural, ns, ref["name"], bool(ref.get("optional")))
                value = data.get(ref["key"])
                return None if value is None else value.decode()
        return None

    def hosts(self) -> str:
        from tide.services.testing.kube.operators import POD

        lines = ["127.0.0.1 localhost"]
        pods = [
            p
            for p in self.api.list(POD)[0]
            if not p["metadata"].get("deletionTimestamp")
            and p["metadata"]["uid"] in self._ips
            and p.get("status", {}).get("phase") == "Running"
        ]
        for svc in self.api.list(_t(self.api, "services"))[0]:
            sel = svc.get("spec", {}).get("selector") or {}
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            for p in pods:
                labels = p["metadata"].get("labels") or {}
                if (
                    sel
                    and p["metadata"]["namespace"] == ns
                    and all(labels.get(k) == v for k, v in sel.items())
                ):
                    ip = self._ips[p["metadata"]["uid"]]
                    fq = f"{name}.{ns}.svc"
                    lines.append(f"{ip} {fq} {fq}.cluster.local {name}.{ns} {name}")
                    break
        return "\n".join(lines) + "\n"

    def refresh_hosts(self) -> None:
        """Cluster DNS: every pod's /etc/hosts, rewritten in place (the bind keeps the inode)."""
        text = self.hosts()
        for h, own in self._hosts:
            if h.exists() and h.read_text() != own + text:
                with open(h, "r+") as f:
                    f.write(own + text)
                    f.truncate()

    def prepare(
        self, pod: Obj, container: Obj, env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """(argv, env) of the container run in its sandbox (``env``: the container's own,
        Downward API resolved; the kubelet adds the machine's); raises ApiError when a
        volume's object is missing (the pod stays Pending, as ContainerCreating)."""
        meta = pod["metadata"]
        ip = self.pod_ip(pod)
        d = self.root / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        for sub in ("layer", "root", "volumes"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        binds: list[tuple[Path, str]] = []
        vols = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for m in container.get("volumeMounts") or []:
            src = self._volume(pod, vols[m["name"]], d / "volumes" / m["name"])
            binds.append((src, m["mountPath"]))
        n_volumes = len(binds)
        # Over the volumes, so that the chart's /tmp emptyDir cannot hide a checkout in
        # /tmp; read-only, as an image's files are to a pod that may not write them.
        install = [(p, str(p)) for p in install_paths()]
        image = self.images.get(container.get("image", ""))
        for target, src in (image.files if image else {}).items():
            binds.append((src, target))
        if pod["spec"].get("automountServiceAccountToken", True) and not any(
            t == SA_DIR for _, t in binds
        ):
            sa = d / "volumes" / "kube-api-access"
            sa.mkdir(parents=True, exist_ok=True)
            (sa / "token").write_bytes(
                self._token(pod, "https://kubernetes.default.svc.cluster.local", 3600)
            )
            (sa / "namespace").write_text(meta["namespace"])
            if self.api.ca_file:
                shutil.copyfile(self.api.ca_file, sa / "ca.crt")
            binds.append((sa, SA_DIR))
        hosts = d / "hosts"
        # The pod's hostname is its name, resolving to its IP (gloo looks itself up).
        own = f"{ip} {meta['name']}\n"
        hosts.write_text(own + self.hosts())
        self._hosts.append((hosts, own))
        binds.append((hosts, "/etc/hosts"))
        # A target through a symlink of the image (/var/run → /run) is where the link
        # leads, inside the pod's root: resolved here, on the same files.
        (d / "binds").write_text(
            "".join(f"{s} {os.path.realpath(t)}\n" for s, t in binds[:n_volumes])
            + "".join(f"{s} {t} ro\n" for s, t in install)
            + "".join(f"{s} {os.path.realpath(t)}\n" for s, t in binds[n_volumes:])
        )
        for e in container.get("env") or []:
            if "valueFrom" in e and "fieldRef" not in e["valueFrom"]:
                value = self.env_from(pod, e)
                if value is not None:
                    env[e["name"]] = value
        env = {k: self._local(v, ip) for k, v in env.items()}
        env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
        env["KUBERNETES_SERVICE_PORT"] = str(self.api.port)
        command = list(container.get("command") or (image.entrypoint if image else ()))
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable  # the venv's, whatever the PATH
        argv = [self._local(a, ip) for a in [*command, *(container.get("args") or [])]]
        # The checkout's code, whichever checkout the venv's editable install serves.
        code = [str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([*code, *filter(None, [env.get("PYTHONPATH")])])
        wrapper = ["unshare", "--mount", "--uts", "--propagation", "private", "--"]
        script = ["sh", "-c", _SCRIPT, "sandbox", str(d), str(d / "binds"), meta["name"]]
        return [*wrapper, *script, *argv], env

    @staticmethod
    def _local(value: str, ip: str) -> str:
        return value.replace("0.0.0.0:", f"{ip}:").replace("127.0.0.1:", f"{ip}:")
