"""Write the three `settings` maps of the Helm chart's values.schema.json from the
services' settings dataclasses, so `helm install` refuses a misspelt or mistyped
setting instead of the pod exiting 2 at start.

The rest of values.schema.json is written by hand; this rewrites only
``properties.{scaler,coordinator,agent}.properties.settings``. `--check` exits 1
when the file is not what this would write (tests/deploy/test_values_schema.py
runs it): a setting added to a service without `make chart-schema` fails CI.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tide.services.agent.settings import AgentSettings
from tide.services.common.config import setting_fields
from tide.services.coordinator.settings import CoordinatorSettings
from tide.services.scaler.settings import ScalerSettings

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "deploy" / "helm" / "tide" / "values.schema.json"

_SERVER = {"listen", "metrics_listen", "health_listen", "config", "db", "admin_token"}
_TLS = {
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "tls_ca_file",
    "tls_client_cert_file",
    "tls_client_key_file",
    "token_file",
    "insecure",
}

#: Per chart section: the settings class, and the settings the chart wires itself
#: (addresses, the store, files it mounts, secrets), which values may not set.
SERVICES: dict[str, tuple[type[Any], frozenset[str]]] = {
    "scaler": (
        ScalerSettings,
        frozenset(
            _SERVER
            | _TLS
            | {"coordinator", "actuator", "kube_namespaces", "local_ca_dir", "trust_configmap"}
            # scaler.replicas > 1: leader election on the release's own Lease.
            | {"leader_election", "lease_name", "lease_namespace", "lease_kubeconfig"}
            | {"advertise_address"}
            # scaler.shards: a top-level value, so it sits beside replicas.
            | {"shards", "peer_tls_server_name"}
        ),
    ),
    "coordinator": (
        CoordinatorSettings,
        frozenset(
            _SERVER
            | _TLS
            # coordinator.replicas > 1: leader election on the release's own lease row.
            | {"leader_election", "lease_name", "owner_id", "advertise_address"}
        ),
    ),
    "agent": (
        AgentSettings,
        frozenset(
            {"listen", "metrics_listen", "config", "scaler", "node_name", "kubeconfig"}
            | {"pod_resources_socket", "replay_path"}
            | _TLS
        ),
    ),
}

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _json_type(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin is tuple:
        return {"type": "array", "items": {"type": "string"}}
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    raise TypeError(f"no JSON schema type for {tp!r}")


def settings_schema(cls: type[Any], owned: frozenset[str]) -> dict[str, Any]:
    """The JSON schema of a `settings` map: the settings of ``cls`` less ``owned``."""
    props: dict[str, Any] = {}
    for st in sorted(setting_fields(cls), key=lambda st: st.name):
        if st.name in owned:
            continue
        prop = _json_type(st.type)
        prop["description"] = st.help
        default = st.default
        prop["default"] = list(default) if isinstance(default, tuple) else default
        props[st.name] = prop
    return {
        "type": "object",
        "description": f"settings of {cls.__name__} (see --help), written to the service's --config file",
        "additionalProperties": False,
        "properties": props,
    }


def render(current: dict[str, Any]) -> str:
    """``current`` with its settings maps regenerated, as the file's text."""
    for section, (cls, owned) in SERVICES.items():
        current["properties"][section]["properties"]["settings"] = settings_schema(cls, owned)
    return json.dumps(current, indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = SCHEMA.read_text()
    wanted = render(json.loads(text))
    if "--check" in argv:
        if text != wanted:
            print(
                f"{SCHEMA.relative_to(ROOT)} is out of date with the services' settings:"
                " run `make chart-schema`",
                file=sys.stderr,
            )
            return 1
        return 0
    SCHEMA.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
