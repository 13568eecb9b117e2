"""Every command written in README.md and docs/, found as a reader finds it.

Two places hold commands: fenced shell blocks (```bash, ```sh, ```console and
untagged ones, where only lines that start with a known program count, since
untagged blocks also hold diagrams and log output) and inline code spans whose
first word is a known program followed by something (a bare `tide` names the
program; `tide jobs` runs it). An HTML comment ``<!-- not-a-command -->`` on the
line before a fence, or on the line of a span, excludes it: an illustration or a
command that fails on purpose.

A command is split the way a shell would: backslash continuations joined,
comments dropped, pipelines and lists (``|``, ``&&``, ``||``, ``;``, ``&``) cut into
simple commands, ``NAME=value`` prefixes taken as the environment, redirections
taken out. Placeholders (``JOB``, ``HOST:PORT``, ``<id>``) and synopses (``[--opt]``,
``a|b``, ``…``) are recognised so the check can give a placeholder a value or check
only the option names of a synopsis (tests/docs/parsing.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_A_COMMAND = "<!-- not-a-command -->"

# Programs a command may start with. Anything else in a shell block fails the
# test until it is added here (and given a check in test_commands_as_written.py).
PROGRAMS = frozenset(
    {
        "tide",
        "python",
        "python3",
        ".venv/bin/python",
        ".venv/bin/pytest",
        ".venv/bin/tide",
        "pytest",
        "make",
        "kubectl",
        "helm",
        "docker",
        "psql",
        "sqlite3",
        "grpcurl",
        "pip",
        "alembic",
        "promtool",
        "git",
        "jq",
        "xargs",
        "openssl",
        "base64",
        "export",
        "cd",
        "curl",
        "bash",
        "sh",
    }
)
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console", ""})
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# An all-capitals word, alone or joined by ':', '/', '.', '=' or '_' (JOB, HOST:PORT,
# NS/NAME, FILE.png, KEY=VALUE, STATE_DIR), or anything in angle brackets.
PLACEHOLDER = re.compile(r"^(?:<[^<>]+>|[A-Z][A-Z0-9_]*(?:[:/=][A-Z][A-Z0-9_]*)*(?:\.[a-z]+)?)$")
ELLIPSES = ("…", "...")


@dataclass(frozen=True)
class Command:
    """One logical command line as written: a pipeline or list of simple commands."""

    file: str
    line: int
    text: str
    inline: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Simple:
    """One simple command of a line: its environment prefix, words and inputs."""

    env: dict[str, str]
    argv: list[str]
    inputs: list[str] = field(default_factory=list)  # files redirected in with '<'

    @property
    def program(self) -> str:
        return self.argv[0] if self.argv else ""


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _starts_command(line: str) -> bool:
    words = line.split()
    while words and ENV_ASSIGN.match(words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS


def extract(path: Path, root: Path = ROOT) -> list[Command]:
    """Every command in one Markdown file, in order."""
    rel = str(path.relative_to(root))
    lines = path.read_text().split("\n")
    out: list[Command] = []
    para: list[tuple[int, str]] = []  # prose since the last blank line: spans may wrap
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w-]*)", lines[i])
        if fence or not lines[i].strip() or lines[i].lstrip().startswith("|"):
            out.extend(_inline_commands(rel, para))
            para = []
        if fence:
            marker, lang = fence.group(1), fence.group(2).lower()
            skip = i > 0 and NOT_A_COMMAND in lines[i - 1]
            i += 1
            body: list[tuple[int, str]] = []
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append((i + 1, lines[i]))
                i += 1
            i += 1
            if not skip and lang in SHELL_LANGS:
                out.extend(_block_commands(rel, lang, body))
            continue
        para.append((i + 1, lines[i]))
        i += 1
    out.extend(_inline_commands(rel, para))
    return out


def _block_commands(rel: str, lang: str, body: list[tuple[int, str]]) -> list[Command]:
    prompted = any(text.lstrip().startswith("$ ") for _, text in body)
    logical: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for lineno, raw in body:
        text = raw.strip()
        if prompted:
            if pending is None and not text.startswith("$ "):
                continue  # output of the command above
            text = text.removeprefix("$ ")
        if pending is not None:
            text = pending[1] + " " + text
            lineno = pending[0]
            pending = None
        if text.endswith("\\"):
            pending = (lineno, text[:-1].rstrip())
            continue
        logical.append((lineno, text))
    if pending is not None:
        logical.append(pending)
    out = []
    for lineno, text in logical:
        if not text or text.startswith("#"):
            continue
        # An untagged block holds diagrams and output too: only program lines count.
        if lang == "" and not _starts_command(text):
            continue
        out.append(Command(rel, lineno, text, inline=False))
    return out


def _inline_commands(rel: str, para: list[tuple[int, str]]) -> list[Command]:
    """The commands in the code spans of a paragraph (or table row); a span may wrap."""
    if not para:
        return []
    first = para[0][0]
    text = "\n".join(line for _, line in para)
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        start = first + text.count("\n", 0, m.start())
        end = first + text.count("\n", 0, m.end())
        if any(NOT_A_COMMAND in line for n, line in para if start <= n <= end):
            continue
        span = " ".join(m.group(1).split()).replace("\\|", "|")
        words = span.split()
        # `tide` names the program, `tide = tide.services.cli.main:main` is an entry point.
        if len(words) < 2 or words[1] == "=" or not _starts_command(span):
            continue
        out.append(Command(rel, start, span, inline=True))
    return out


def all_commands(root: Path = ROOT) -> list[Command]:
    return [c for path in doc_files(root) for c in extract(path, root)]


def split_line(cmd: Command) -> list[Simple]:
    """The simple commands of a line. Inline spans are one command whose ``|`` are
    alternatives (``-o table|json``); in blocks a ``|`` between spaces is a pipe."""
    parts = [cmd.text] if cmd.inline else _split_list(cmd.text)
    return [_simple(p) for p in parts if p.strip()]


def _split_list(text: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    quote = ""
    depth = 0  # inside $( ... )
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"' and i + 1 < len(text):
                cur.append(ch)
                i += 1
                ch = text[i]
            cur.append(ch)
            i += 1
            continue
        if ch in "'\"":
            quote = ch
        elif text.startswith("$(", i):
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif depth == 0 and ch == "#" and (i == 0 or text[i - 1].isspace()):
            break  # a comment
        elif depth == 0:
            op = _operator_at(text, i)
            if op:
                parts.append("".join(cur))
                cur = []
                i += len(op)
                continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return parts


def _operator_at(text: str, i: int) -> str:
    for op in ("&&", "||", ";", "|", "&"):
        if text.startswith(op, i):
            before = text[i - 1] if i else " "
            after = text[i + len(op)] if i + len(op) < len(text) else " "
            # '2>&1' and 'a|b' are not list operators: they need spaces around.
            if op == ";" or (before.isspace() and after.isspace()):
                return op
            return ""
    return ""


def _simple(text: str) -> Simple:
    words = shlex.split(text, comments=True)
    env: dict[str, str] = {}
    while words and ENV_ASSIGN.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    argv: list[str] = []
    inputs: list[str] = []
    it = iter(words)
    for w in it:
        if w in (">", ">>", "2>", "<"):
            target = next(it, "")
            if w == "<":
                inputs.append(target)
            continue
        if re.match(r"^\d?>&\d$", w) or re.match(r"^\d?>>?\S+$", w):
            continue
        argv.append(w)
    return Simple(env, argv, inputs)


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.match(word)) or word in ELLIPSES


def is_synopsis(argv: list[str]) -> bool:
    """A usage line rather than a command: optional parts, alternatives or an
    ellipsis. Only its option names (and the choices it lists) can be checked."""
    for w in argv:
        if w in ELLIPSES or w.endswith(("…", "...")) or w.startswith("[") or w.endswith("]"):
            return True
        if "|" in w and not w.startswith(("jsonpath=", "{")):
            return True
    return False


def synopsis_words(argv: list[str]) -> list[str]:
    """A synopsis's words with the brackets and ellipses taken off."""
    out = []
    for w in argv:
        w = w.strip("[]").rstrip("…").removesuffix("...")
        if w and w not in ELLIPSES and w != "|":
            out.append(w)
    return out
