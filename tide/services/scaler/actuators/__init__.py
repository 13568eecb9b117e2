"""The scaler's actuators: the interface (``base``) and one module per real one.

Adding an actuator (Kubernetes, say) is one new module implementing
:class:`Actuator`, one branch in :func:`make_actuator` (and its kind in
ScalerSettings.check_actuator), and a parameter of the contract suite
(tests/scaler/test_actuator_contract.py).
"""

from __future__ import annotations

from pathlib import Path

from tide.base.errors import ConfigError
from tide.services.common.clock import Clock
from tide.services.scaler.actuators.base import (
    Actuator,
    PodRemover,
    acting_while,
    check_still_leading,
    owner_epoch,
    remove_pods,
)

__all__ = [
    "KINDS",
    "Actuator",
    "PodRemover",
    "acting_while",
    "check_still_leading",
    "make_actuator",
    "owner_epoch",
    "parse_actuator",
    "remove_pods",
]

#: The kinds ``--actuator KIND:ARG`` accepts.
KINDS = ("local", "kubernetes")


def parse_actuator(spec: str) -> tuple[str, str]:
    """``--actuator KIND:ARG`` as (kind, arg); a ConfigError saying what to pass otherwise."""
    kind, sep, arg = spec.partition(":")
    if kind not in KINDS or not sep or not arg:
        raise ConfigError(
            f"actuator: expected local:DIR or kubernetes:in-cluster|KUBECONFIG, got {spec!r};"
            " pass --actuator local:DIR or --actuator kubernetes:in-cluster"
        )
    return kind, arg


def make_actuator(
    spec: str,
    *,
    coordinator: str,
    total_gpus: int | None,
    clock: Clock,
    ca_dir: str = "",
    namespaces: tuple[str, ...] = (),
) -> Actuator:
    """The actuator ``spec`` (``--actuator``) names."""
    kind, arg = parse_actuator(spec)
    if kind == "kubernetes":
        # Imported here: a scaler in local mode never loads the kubernetes client.
        from tide.services.scaler.actuators.kubernetes import (
            KubernetesActuator,
            KubernetesActuatorSettings,
        )

        return KubernetesActuator(KubernetesActuatorSettings(source=arg, namespaces=namespaces))
    if kind == "local":
        # Imported here: a scaler deployed with another actuator never loads local mode.
        from tide.services.scaler.actuators.local import LocalActuator, LocalActuatorSettings

        return LocalActuator(
            LocalActuatorSettings(
                state_dir=Path(arg),
                coordinator=coordinator,
                total_gpus=total_gpus,
                ca_dir=Path(ca_dir) if ca_dir else None,
            ),
            clock,
        )
    raise AssertionError(f"actuator kind {kind!r} is in KINDS but has no branch here")
