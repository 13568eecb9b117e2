#!/usr/bin/env bash
# Create a venv (.venv unless VENV says otherwise) and install Tide with its extras
# (EXTRAS; every extra but paddleformers by default), unless the venv already holds an
# install of this very pyproject.toml. The stamp is the file's hash rather than a make
# timestamp: a fresh clone that reuses a venv (a symlink to another checkout's) must not
# reinstall into it, which would repoint the editable install at the clone.
# UNPINNED (a regex of package names) drops those pins of constraints.txt: `make
# frameworks` builds .venv-frameworks so, the paddleformers extra needing older numpy,
# pyarrow and fsspec than the main venv's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-services,trainer,paddle-cpu,demo,dev}
UNPINNED=${UNPINNED:-}
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
repo=$(pwd -P)
# Whether the venv's editable install serves this checkout (run from / so that the
# current directory does not answer instead); a venv of this checkout's own that
# another checkout reinstalled into points elsewhere, and `tide` may then be gone.
serves_here() {
    [ "$(cd / && "$repo/$VENV/bin/python" -c 'import tide.base; print(tide.base.__path__[0])' 2>/dev/null)" = "$repo/tide/base" ]
}
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.installed" 2>/dev/null)" = "$want" ] \
    && { [ -L "$VENV" ] || serves_here; }; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# constraints.txt: the versions the suite passed with, as the images install them.
constraints=constraints.txt
if [ -n "$UNPINNED" ]; then
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    grep -v -E "^($UNPINNED)==" constraints.txt > "$constraints"
fi
# Bytecode is compiled at install (pip's default, uv's --compile-bytecode): where
# PYTHONDONTWRITEBYTECODE is set (this project's machines and CI) nothing would write it
# later, and every process of the suite compiled Paddle's modules from source at each
# start (docs/reliability.md, "The suite").
# uv installs the same pinned set in about a third of pip's time (it downloads, unpacks
# and compiles in parallel: docs/reliability.md has the figures). It comes from the same
# registry as everything else; where it cannot be had or cannot install (a registry only
# pip's own configuration names), pip does the install as before.
if "$VENV/bin/python" -m pip install -q -c "$constraints" uv \
    && "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" --compile-bytecode \
        -c "$constraints" -e ".[$EXTRAS]"; then
    :
else
    echo "setup: uv could not install; installing with pip" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[$EXTRAS]"
fi
echo "$want" > "$VENV/.installed"
