"""The CA bundle in every training namespace: what a launcher needs to verify the
coordinator, put where its pod can mount it (issue 32; docs/install.md, "Credentials
for the trainers").

A pod can mount only ConfigMaps of its own namespace, and the coordinator's CA lives in
the release's. Like ``kube-root-ca.crt`` (which Kubernetes puts into every namespace)
and trust-manager's Bundle, the scaler copies the CA it already holds (its own
``--tls-ca-file``, which verifies the coordinator) into a ConfigMap (``--trust-configmap``,
key ``ca.crt``) of each namespace that holds an opted-in PaddleJob, and writes it again
when the file changes (a CA rotation). Only the CA: public, no key. The ConfigMap is
labelled as Tide's and left in place when a job goes (other jobs of the namespace, and
pods still starting, mount it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tide.base.credentials import WatchedFile
from tide.base.errors import Unavailable

logger = logging.getLogger(__name__)

#: The key a launcher's mount reads (the examples mount it at /var/run/tide/ca/ca.crt).
KEY = "ca.crt"
#: Marks a ConfigMap as the scaler's copy: it is never written over one without it.
LABELS = {"app.kubernetes.io/managed-by": "tide-scaler", "tide.dev/trust-bundle": "true"}


class TrustBundle:
    """Keeps ConfigMap ``name`` in each namespace asked for equal to the CA in ``ca_file``."""

    def __init__(
        self, api: client.ApiClient, name: str, ca_file: str, *, request_timeout_s: float = 30.0
    ) -> None:
        self.name = name
        self.ca_file = ca_file
        # Read again only when the file changes; its last text kept while it cannot be
        # read (a Secret mid-swap must not end discovery, which calls ensure every pass).
        self._ca = WatchedFile(ca_file)
        self._core = client.CoreV1Api(api)
        self._timeout_s = request_timeout_s
        #: The CA written into each namespace.
        self.written: dict[str, str] = {}

    async def ensure(self, namespaces: Iterable[str]) -> None:
        """Write the CA into every namespace of ``namespaces`` that lacks it (or holds an
        older one); a namespace that refuses is logged and tried at the next pass."""
        pem = await asyncio.to_thread(self._ca.read)
        if not pem:
            logger.warning("trust bundle: no CA in %s yet; nothing copied", self.ca_file)
            return
        for ns in sorted(set(namespaces)):
            if self.written.get(ns) == pem:
                continue
            try:
                await asyncio.to_thread(self._apply, ns, pem)
            except (ApiException, Unavailable) as exc:
                logger.warning(
                    "trust bundle: ConfigMap %s/%s not written: %s",
                    ns,
                    self.name,
                    getattr(exc, "reason", exc),
                    extra={"namespace": ns},
                )
                if isinstance(exc, Unavailable):
                    self.written[ns] = pem  # someone else's: said once, not every pass
                continue
            self.written[ns] = pem
            logger.info("trust bundle: the CA is in ConfigMap %s/%s", ns, self.name)

    def _apply(self, ns: str, pem: str) -> None:
        body = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=self.name, namespace=ns, labels=dict(LABELS)),
            data={KEY: pem},
        )
        try:
            current = self._core.read_namespaced_config_map(
                self.name, ns, _request_timeout=self._timeout_s
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._core.create_namespaced_config_map(ns, body, _request_timeout=self._timeout_s)
            return
        labels = (current.metadata.labels if current.metadata else None) or {}
        if labels.get("tide.dev/trust-bundle") != "true":
            raise Unavailable(
                f"ConfigMap {ns}/{self.name} exists and is not Tide's (no label"
                " tide.dev/trust-bundle=true): left alone"
            )
        if (current.data or {}).get(KEY) != pem:
            self._core.patch_namespaced_config_map(
                self.name, ns, {"data": {KEY: pem}}, _request_timeout=self._timeout_s
            )
