"""Contexts, in the spirit of kubeconfig: named sets of the connection settings (the
scaler's address, the CA, the client certificate and key, the token file, the server
name), one of them current, in one YAML file.

    tide config set-context prod --scaler 127.0.0.1:50051 --tls-ca-file ca.crt \\
        --token-file ~/.tide-token --tls-server-name tide-scaler
    tide config use-context prod
    tide config get-contexts
    tide history ml/resnet                  # with prod's settings
    tide history ml/resnet --context dev    # another, for one command

The file is ``~/.config/tide/contexts.yaml``, or ``TIDE_CONTEXTS_FILE``. A flag or
its environment variable wins over the context, the context over the built-in default
(tide/services/cli/connection.py applies them in that order).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from tide.services.cli.app import Exit, echo, fail
from tide.services.common.files import write_atomic

ENV_FILE = "TIDE_CONTEXTS_FILE"
ENV_CONTEXT = "TIDE_CONTEXT"
#: What a context may hold: the connection settings' names (tide/services/cli/connection.py).
FIELDS = (
    "scaler",
    "tls_ca_file",
    "tls_client_cert_file",
    "tls_client_key_file",
    "token_file",
    "tls_server_name",
)

config_app = typer.Typer(
    help="Contexts: named connection settings, one current (like kubeconfig).",
    no_args_is_help=True,
)


def path() -> Path:
    given = os.environ.get(ENV_FILE)
    return Path(given) if given else Path.home() / ".config" / "tide" / "contexts.yaml"


def load() -> dict[str, Any]:
    """The file's document ({} when there is none); exit 2 naming a broken one."""
    p = path()
    if not p.exists():
        return {}
    import yaml  # only with a contexts file: not a start-up cost of every command

    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        fail(Exit.USAGE, f"contexts file {p}: {exc}")
    if doc is None:
        doc = {}
    if not isinstance(doc, dict) or not isinstance(doc.get("contexts", {}), dict):
        fail(Exit.USAGE, f"contexts file {p}: expected a mapping with 'contexts'")
    return doc


def _save(doc: Mapping[str, Any]) -> None:
    import yaml

    # Paths of keys and tokens, not their content; still the user's alone.
    write_atomic(path(), yaml.safe_dump(dict(doc), sort_keys=False).encode(), private=True)


def settings(name: str = "") -> dict[str, str]:
    """The settings of context ``name`` (``TIDE_CONTEXT``, else the current one; {} when
    none is set). Exit 2 naming a context that does not exist or a setting it cannot hold."""
    name = name or os.environ.get(ENV_CONTEXT, "")
    doc = load()
    name = name or str(doc.get("current-context") or "")
    if not name:
        return {}
    contexts = doc.get("contexts") or {}
    if name not in contexts:
        fail(Exit.USAGE, f"context {name!r} not in {path()} (tide config get-contexts)")
    ctx = contexts[name] or {}
    unknown = sorted(set(ctx) - set(FIELDS))
    if unknown:
        fail(Exit.USAGE, f"context {name!r} in {path()}: unknown settings {unknown}")
    return {k: str(v) for k, v in ctx.items() if v not in (None, "")}


def _opt(flag: str, what: str) -> Any:
    return typer.Option(flag, help=what, show_default=False)


@config_app.command("set-context")
def set_context(
    name: Annotated[str, typer.Argument(help="the context's name")],
    scaler: Annotated[str, _opt("--scaler", "scaler gRPC address HOST:PORT")] = "",
    tls_ca_file: Annotated[str, _opt("--tls-ca-file", "CA (PEM) of the scaler")] = "",
    tls_client_cert_file: Annotated[
        str, _opt("--tls-client-cert-file", "client certificate (PEM), mTLS")
    ] = "",
    tls_client_key_file: Annotated[str, _opt("--tls-client-key-file", "client key (PEM)")] = "",
    token_file: Annotated[str, _opt("--token-file", "file holding a bearer token")] = "",
    tls_server_name: Annotated[
        str, _opt("--tls-server-name", "name the scaler's certificate holds")
    ] = "",
) -> None:
    """Create a context, or change the settings given of an existing one."""
    given = {k: v for k, v in locals().items() if k in FIELDS}
    # Files by absolute path: the context is used from any directory.
    for key in ("tls_ca_file", "tls_client_cert_file", "tls_client_key_file", "token_file"):
        if given[key]:
            given[key] = str(Path(given[key]).expanduser().resolve())
    doc = load()
    contexts = doc.setdefault("contexts", {})
    ctx = dict(contexts.get(name) or {})
    ctx.update({k: v for k, v in given.items() if v})
    contexts[name] = ctx
    _save(doc)
    echo(f"context {name} set in {path()}")


@config_app.command("use-context")
def use_context(name: Annotated[str, typer.Argument(help="the context to make current")]) -> None:
    """Make a context the current one."""
    doc = load()
    if name not in (doc.get("contexts") or {}):
        fail(Exit.USAGE, f"context {name!r} not in {path()}; create it with set-context")
    doc["current-context"] = name
    _save(doc)
    echo(f"switched to context {name}")


@config_app.command("current-context")
def current_context() -> None:
    """Print the current context's name."""
    name = load().get("current-context")
    if not name:
        fail(Exit.NOT_FOUND, f"no current context in {path()}")
    echo(str(name))


@config_app.command("get-contexts")
def get_contexts() -> None:
    """List the contexts; the current one is marked with *."""
    doc = load()
    current = doc.get("current-context")
    rows = [("CURRENT", "NAME", "SCALER", "SERVER NAME")]
    for name, ctx in (doc.get("contexts") or {}).items():
        ctx = ctx or {}
        rows.append(
            (
                "*" if name == current else "",
                str(name),
                str(ctx.get("scaler", "")),
                str(ctx.get("tls_server_name", "")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
