"""`-o` for every read command, kubectl's way: table, wide, json, yaml, jsonpath=EXPR
(csv too where a command has rows), and ``--no-headers`` for the tables.

A command builds one JSON document (render.py, schema-versioned) and, for the
tables, headers and rows; this module prints whichever the user asked for.
Tables are plain aligned columns when stdout is not a terminal (no box
drawing, no colour: awk and cut see fields), and rich tables on a terminal.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import typer

#: The formats every read command takes; ``csv`` is added where a command has rows.
FORMATS = ("table", "wide", "json", "yaml", "jsonpath=EXPR")

OutputOpt = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        help="table, wide, json, yaml, or jsonpath=EXPR (e.g. jsonpath='{.jobs[*].job_id}')",
    ),
]
NoHeadersOpt = Annotated[bool, typer.Option("--no-headers", help="tables without their header row")]


@dataclass(frozen=True)
class Output:
    kind: str  # table, wide, json, yaml, csv, jsonpath
    jsonpath: str = ""

    @property
    def tabular(self) -> bool:
        return self.kind in ("table", "wide")

    @property
    def wide(self) -> bool:
        return self.kind == "wide"


def parse_output(text: str, *, csv_ok: bool = False) -> Output:
    """``-o``'s value; ValueError with the accepted forms when it is none of them."""
    value = text.strip()
    if value.startswith("jsonpath="):
        expr = value.removeprefix("jsonpath=")
        if not expr:
            raise ValueError("jsonpath= needs an expression, e.g. jsonpath='{.jobs[*].job_id}'")
        _compile(expr)
        return Output("jsonpath", expr)
    kinds = ("table", "wide", "json", "yaml", *(("csv",) if csv_ok else ()))
    if value not in kinds:
        accepted = ", ".join((*kinds, "jsonpath=EXPR"))
        raise ValueError(f"unknown output format {text!r} (one of {accepted})")
    return Output(value)


def _compile(expr: str) -> Any:
    """kubectl's ``{.a.b[*]}`` or plain JSONPath ``$.a.b[*]``, compiled by jsonpath-ng."""
    from jsonpath_ng.exceptions import JsonPathLexerError, JsonPathParserError
    from jsonpath_ng.ext import parse  # type: ignore[attr-defined]

    body = expr.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    if body.startswith("."):
        body = "$" + body
    try:
        return parse(body)
    except (JsonPathLexerError, JsonPathParserError, Exception) as exc:
        raise ValueError(f"jsonpath {expr!r}: {exc}") from None


def jsonpath_values(doc: Any, expr: str) -> list[str]:
    """Each match of ``expr`` in ``doc``: strings as they are, the rest as JSON."""
    out = []
    for match in _compile(expr).find(doc):
        v = match.value
        out.append(v if isinstance(v, str) else json.dumps(v))
    return out


def is_terminal() -> bool:
    return sys.stdout.isatty()


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, no_headers: bool) -> str:
    """Columns padded with spaces, three between them, kubectl-style; the last column
    is not padded. Cells are one line each (newlines become spaces)."""
    cells = [[" ".join(str(c).split()) or "-" for c in row] for row in rows]
    shown = cells if no_headers else [list(headers), *cells]
    if not shown:
        return ""
    widths = [max(len(r[i]) for r in shown) for i in range(len(headers))]
    lines = []
    for r in shown:
        parts = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)]
        lines.append("   ".join([*parts, r[-1]]).rstrip())
    return "\n".join(lines) + "\n"


#: Above this many rows a table is printed plain even on a terminal: rich measures
#: every cell of every row before it prints the first (20,000 rows took 36 s).
RICH_MAX_ROWS = 500


class PlainStream:
    """A plain table printed as its rows arrive (`tide history --all`): the column
    widths are those of the header and the first batch; a later cell that is wider
    pushes its row's next columns right instead of holding everything back.

    ``free_text``: the columns whose cells may hold any text (a message, a name given
    by a person): their whitespace is folded to single spaces. The others are the
    caller's own formatting, printed as they are (folding 100,000 rows' every cell was
    a sixth of `tide history --all`) and must not be empty; an empty free-text cell
    is "-"."""

    def __init__(
        self,
        headers: Sequence[str],
        *,
        no_headers: bool,
        free_text: Sequence[int] | None = None,
    ) -> None:
        self.headers = list(headers)
        self.no_headers = no_headers
        self.widths: list[int] | None = None
        self.line: Callable[..., str] = "".format
        n = len(self.headers)
        self.free_text = sorted({i % n for i in (range(n) if free_text is None else free_text)})

    def write(self, rows: Sequence[Sequence[str]]) -> None:
        free = self.free_text
        cells = []
        for row in rows:
            cell = list(row)
            for i in free:
                cell[i] = " ".join(cell[i].split()) or "-"
            cells.append(cell)
        if self.widths is None:
            shown = [self.headers, *cells]
            self.widths = [max(len(r[i]) for r in shown) for i in range(len(self.headers))]
            # One format per table: a row is then one C call, not a ljust per cell
            # (a third of the plain table's time for 100,000 rows). "{:<w}" pads as
            # ljust does and, like it, never cuts a wider cell.
            self.line = "   ".join(
                [*(f"{{:<{w}}}" if w else "{}" for w in self.widths[:-1]), "{}"]
            ).format
            if not self.no_headers:
                cells = [self.headers, *cells]
        if not cells:
            return
        line = self.line
        typer.echo("\n".join([line(*r).rstrip() for r in cells]))


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, no_headers: bool = False
) -> None:
    if not is_terminal() or len(rows) > RICH_MAX_ROWS:
        typer.echo(plain_table(headers, rows, no_headers=no_headers), nl=False)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(show_edge=False, header_style="bold", show_header=not no_headers)
    for i, h in enumerate(headers):
        t.add_column(h, overflow="fold" if i == len(headers) - 1 else "ellipsis")
    for r in rows:
        t.add_row(*r)
    Console(soft_wrap=False).print(t)


def csv_text(headers: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(headers), lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(r)
    return buf.getvalue()


def emit_document(doc: dict[str, Any], out: Output) -> bool:
    """Print ``doc`` for json, yaml and jsonpath; False when ``out`` is a table (or csv)."""
    if out.kind == "json":
        typer.echo(json.dumps(doc, indent=2))
    elif out.kind == "yaml":
        import yaml  # only -o yaml needs it: not a start-up cost of every command

        typer.echo(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), nl=False)
    elif out.kind == "jsonpath":
        for value in jsonpath_values(doc, out.jsonpath):
            typer.echo(value)
    else:
        return False
    return True
