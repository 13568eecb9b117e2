#!/usr/bin/env bash
# Create .venv and install Tide with every extra, unless the venv already holds an
# install of this very pyproject.toml. The stamp is the file's hash rather than a make
# timestamp: a fresh clone that reuses a venv (a symlink to another checkout's) must not
# reinstall into it, which would repoint the editable install at the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat .venv/.installed 2>/dev/null)" = "$want" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[services,trainer,paddle-cpu,demo,dev]'
echo "$want" > .venv/.installed
