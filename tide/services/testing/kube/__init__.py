"""A Kubernetes cluster for tests: an API server emulator over real HTTP, and
stand-ins for the PaddleJob operators and the kubelet.

- :mod:`.apiserver`: core v1 (Namespaces, Nodes, Pods, Events), Leases,
  HPAs, CRDs and their custom resources under their groups; resourceVersion,
  409, watches with 410, patches, selectors, discovery. The official
  ``kubernetes`` client and the real ``kubectl`` talk to it unchanged
  (its parts: :mod:`.resources`, :mod:`.store`, :mod:`.watch`,
  :mod:`.semantics`, :mod:`.wire`).
- :mod:`.operators`: the reconcilers of paddle-operator and Kubeflow's
  training-operator, pods by index from the replicas.
- :mod:`.kubelet`: runs each pod's container command as a local process with
  the Downward API's environment, reports its phase, stops it on deletion;
  with :mod:`.sandbox`, in a pod sandbox (volumes at their mount paths,
  cluster DNS, a pod IP of its own).
- :mod:`.auth`: bound ServiceAccount tokens, TokenReview, bearer checks;
  :mod:`.controllers`: Deployments, DaemonSets, cert-manager's Certificates;
  :mod:`.chartrun`: the Helm chart installed and run on all of it.

A test double: no production module may import it (import-linter).
"""

from tide.services.testing.kube.apiserver import KubeApiServer, ResourceType
from tide.services.testing.kube.semantics import ApiError

__all__ = ["ApiError", "KubeApiServer", "ResourceType"]
