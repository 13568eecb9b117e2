#!/usr/bin/env bash
# Create .venv and install Tide with every extra, unless the venv already holds an
# install of this very pyproject.toml. The stamp is the file's hash rather than a make
# timestamp: a fresh clone that reuses a venv (a symlink to another checkout's) must not
# reinstall into it, which would repoint the editable install at the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
repo=$(pwd -P)
# Whether the venv's editable install serves this checkout (run from / so that the
# current directory does not answer instead); a venv of this checkout's own that
# another checkout reinstalled into points elsewhere, and `tide` may then be gone.
serves_here() {
    [ "$(cd / && "$repo/.venv/bin/python" -c 'import tidebase; print(tidebase.__path__[0])' 2>/dev/null)" = "$repo/tidebase" ]
}
if [ -x .venv/bin/python ] && [ "$(cat .venv/.installed 2>/dev/null)" = "$want" ] \
    && { [ -L .venv ] || serves_here; }; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# constraints.txt: the versions the suite passed with, as the images install them.
.venv/bin/python -m pip install -q -c constraints.txt -e '.[services,trainer,paddle-cpu,demo,dev]'
echo "$want" > .venv/.installed
