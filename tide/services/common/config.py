"""Settings: frozen dataclasses loaded from flags, TIDE_* environment and a YAML file.

Precedence, highest first: command-line flag, environment variable, file,
default. Every field of a settings dataclass becomes a flag (``cooldown_s`` →
``--cooldown-s``) and an environment variable (``TIDE_COOLDOWN_S``); its help
text comes from ``field(metadata={"help": ...})``. A bad value raises
ConfigError naming the field, the source and the value; the entry points print
that one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tide.base.credentials import ClientCredentials
from tide.base.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "TIDE_"


def setting(default: Any, help: str) -> Any:
    """A settings field with its help text (shown by --help and in docs)."""
    return dataclasses.field(default=default, metadata={"help": help})


def setting_group(default: Any, help: str) -> Any:
    """A settings field holding a frozen dataclass (``default``, whose fields give every
    default): each of its fields is a setting of its own, flag, environment variable
    and file key by its own name (``cooldown_s`` -> ``--cooldown-s``), its help the
    group's followed by the field's own (``metadata={"help": ...}``, if any). The
    group's class validates its fields when built."""
    if not dataclasses.is_dataclass(default) or isinstance(default, type):
        raise TypeError(f"setting_group: {default!r} is not a dataclass instance")
    return dataclasses.field(default=default, metadata={"help": help, "group": True})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One flag, environment variable and file key of a settings class."""

    name: str
    type: Any
    default: Any
    help: str
    # The group field it belongs to (setting_group); None for a plain field.
    group: str | None = None


def setting_fields(cls: type[Any]) -> list[Setting]:
    """Every setting of ``cls``: its plain fields and the fields of its groups."""
    hints = typing.get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
            group: Any = f.default
            inner = type(group)
            inner_hints = typing.get_type_hints(inner)
            for g in dataclasses.fields(inner):
                own = g.metadata.get("help", "")
                help_text = f"{f.metadata['help']}: {own}" if own else f.metadata["help"]
                out.append(
                    Setting(
                        g.name, inner_hints[g.name], getattr(f.default, g.name), help_text, f.name
                    )
                )
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(Setting(f.name, hints[f.name], default, f.metadata.get("help", "")))
    names = [s.name for s in out]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: a setting is named twice across its groups")
    return out


def check_hostport(name: str, value: str) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is HOST:PORT."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: expected HOST:PORT, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What every long-running Tide process accepts, the node agent included:
    its settings file, logs, metrics and how long a shutdown may drain."""

    metrics_listen: str = setting(
        "", "Prometheus /metrics HTTP address, HOST:PORT; empty disables it"
    )
    config: str = setting("", "YAML settings file; its keys are the flag names")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = setting("text", "text or json")
    grace_period_s: float = setting(
        10.0, "on SIGTERM, how long in-flight RPCs may finish before they are cancelled"
    )

    def __post_init__(self) -> None:
        if self.metrics_listen:
            check_hostport("metrics_listen", self.metrics_listen)
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(
                f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if self.log_format not in {"text", "json"}:
            raise ConfigError(f"log_format: expected text or json, got {self.log_format!r}")
        if self.grace_period_s < 0:
            raise ConfigError(f"grace_period_s: must be >= 0, got {self.grace_period_s!r}")


@dataclasses.dataclass(frozen=True)
class CommonSettings(ProcessSettings):
    """What every Tide gRPC API service (scaler, coordinator) accepts on top: where it
    listens, its server certificate, who it accepts (docs/security.md). The agent
    serves no API and dials out with client credentials, so it builds on
    :class:`ProcessSettings`."""

    listen: str = setting("127.0.0.1:50051", "gRPC listen address, HOST:PORT (port 0 picks one)")
    health_listen: str = setting(
        "",
        "plaintext gRPC health address HOST:PORT for the kubelet's probe (health only,"
        " no credentials); empty: none",
    )
    tls_cert_file: str = setting("", "server certificate (PEM); enables TLS")
    tls_key_file: str = setting("", "server private key (PEM)")
    tls_client_ca_file: str = setting(
        "", "CA bundle (PEM) that client certificates must chain to; enables mTLS"
    )
    insecure: bool = setting(
        False,
        "accept callers without credentials, as anonymous (local use only; logs a warning);"
        " without TLS this is required",
    )
    admin_token: str = setting(
        "", "bearer token that makes a caller admin; in insecure mode it guards the admin calls"
    )
    token_review: bool = setting(
        False,
        "check bearer ServiceAccount tokens with the Kubernetes TokenReview API (in-cluster)",
    )
    token_audience: str = setting("tide", "the audience ServiceAccount tokens must be bound to")
    token_identities: tuple[str, ...] = setting(
        (),
        "NAMESPACE/SERVICEACCOUNT=KIND, comma-separated: what a reviewed token is (agent,"
        " launcher, scaler, viewer, operator, admin)",
    )
    otlp_endpoint: str = setting(
        "", "OpenTelemetry collector HOST:PORT (OTLP/gRPC): one trace per decision; empty: off"
    )
    max_inflight_unary_calls: int = setting(
        512, "unary calls in flight at most; past it RESOURCE_EXHAUSTED with retry advice"
    )
    max_inflight_streams: int = setting(
        20000,
        "streams (telemetry, directives, watches) open at most; past it RESOURCE_EXHAUSTED",
    )

    def __post_init__(self) -> None:
        check_hostport("listen", self.listen)
        if self.health_listen:
            check_hostport("health_listen", self.health_listen)
        for name in ("max_inflight_unary_calls", "max_inflight_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.otlp_endpoint:
            check_hostport("otlp_endpoint", self.otlp_endpoint)
        super().__post_init__()
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        self.token_kinds()

    def token_kinds(self) -> dict[str, str]:
        kinds: dict[str, str] = {}
        allowed = {"agent", "launcher", "scaler", "viewer", "operator", "admin"}
        for item in self.token_identities:
            sa, sep, kind = item.partition("=")
            if not sep or sa.count("/") != 1 or kind not in allowed:
                raise ConfigError(
                    f"token_identities: expected NAMESPACE/SERVICEACCOUNT=KIND with KIND one of"
                    f" {', '.join(sorted(allowed))}, got {item!r}"
                )
            kinds[sa] = kind
        return kinds

    def security_problem(self) -> str:
        """Why this server must not start as configured, or "" (checked by the entry
        point, so a production process never serves plaintext by accident)."""
        if self.tls_cert_file or self.insecure:
            return ""
        return (
            "no TLS: pass --tls-cert-file and --tls-key-file (and --tls-client-ca-file for"
            " mTLS), or --insecure to accept callers without credentials (local use only)"
        )


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """What a Tide process presents when it dials another (tide.base.credentials): one
    naming scheme for the agent, the scaler's coordinator link, launchers and the CLI."""

    tls_ca_file: str = setting("", "CA bundle (PEM) that the server's certificate must chain to")
    tls_client_cert_file: str = setting("", "client certificate (PEM) presented for mTLS")
    tls_client_key_file: str = setting("", "client private key (PEM) for mTLS")
    token_file: str = setting(
        "", "file holding a bearer token (a projected ServiceAccount token), re-read on change"
    )

    def credentials(self) -> ClientCredentials:
        """The credentials; ConfigError naming the setting if they do not fit together."""
        return ClientCredentials.of(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """int | None → int; leaves plain types alone."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _convert(name: str, source: str, tp: Any, raw: Any) -> Any:
    tp = _base_type(tp)
    where = f"{name} (from {source})"
    if raw is None:
        return None
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off"}:
                return False
            raise ValueError
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError
            return value
        if tp is str:
            if isinstance(raw, (dict, list)):
                raise ValueError
            return str(raw)
        if typing.get_origin(tp) is tuple:
            items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
            return tuple(str(i).strip() for i in items if str(i).strip())
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a finite number"}.get(
            tp, "a value"
        )
        raise ConfigError(f"{where}: expected {kind}, got {raw!r}") from None
    raise ConfigError(f"{where}: unsupported setting type {tp!r}")


def build_parser(cls: type[Any], *, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for st in setting_fields(cls):
        env = ENV_PREFIX + st.name.upper()
        shown = f"{st.help} [env {env}; default {st.default!r}]"
        if _base_type(st.type) is bool:
            parser.add_argument(
                _flag(st.name),
                dest=st.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=shown,
            )
        else:
            parser.add_argument(
                _flag(st.name), dest=st.name, default=None, metavar="VALUE", help=shown
            )
    return parser


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str = "tide",
    description: str = "",
    env: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from flags (``argv``), the environment and the YAML file named by
    ``--config`` or TIDE_CONFIG. Raises ConfigError naming the bad value."""
    env = os.environ if env is None else env
    parser = build_parser(cls, prog=prog, description=description)
    flags = vars(parser.parse_args(list(argv) if argv is not None else None))
    settings = setting_fields(cls)
    hints = {st.name: st.type for st in settings}
    names = set(hints)
    values: dict[str, Any] = {}

    config_path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG", "")
    if config_path:
        try:
            loaded = yaml.safe_load(Path(config_path).read_text())
        except OSError as exc:
            raise ConfigError(f"config: cannot read {config_path!r}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config: {config_path!r} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {config_path!r} must hold a mapping of setting names")
        for key, raw in loaded.items():
            name = str(key).replace("-", "_")
            if name not in names:
                raise ConfigError(f"{key} (from {config_path}): unknown setting")
            values[name] = _convert(name, config_path, hints[name], raw)
        if "config" in names:
            values["config"] = config_path

    for name in names:
        env_name = ENV_PREFIX + name.upper()
        if env_name in env:
            values[name] = _convert(name, env_name, hints[name], env[env_name])

    for name in names:
        raw = flags.get(name)
        if raw is not None:
            values[name] = _convert(name, _flag(name), hints[name], raw)

    return cls(**_grouped(cls, settings, values))


def _grouped(cls: type[Any], settings: list[Setting], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` by setting name as ``cls``'s arguments: each group built from its
    default with the values given for its fields."""
    group_of = {st.name: st.group for st in settings}
    out = {k: v for k, v in values.items() if group_of[k] is None}
    for f in dataclasses.fields(cls):
        given = {k: v for k, v in values.items() if group_of[k] == f.name}
        if given:
            group: Any = f.default
            out[f.name] = dataclasses.replace(group, **given)
    return out
