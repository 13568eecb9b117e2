#!/usr/bin/env bash
# Create .venv-frameworks: Tide with the paddleformers extra, for `make frameworks`.
# Its own venv because PaddleFormers 1.2 pins numpy <= 1.26.4 while the main venv's
# constraints.txt holds numpy 2 (pyproject.toml, the paddleformers extra). The other
# pins of constraints.txt still apply, but for numpy, pyarrow and fsspec: the datasets
# release that fits pyarrow < 21 (4.0) wants an older fsspec than ours.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv-frameworks/bin/python ] && [ "$(cat .venv-frameworks/.installed 2>/dev/null)" = "$want" ]; then
    exit 0
fi
[ -x .venv-frameworks/bin/python ] || "$PYTHON" -m venv .venv-frameworks
.venv-frameworks/bin/python -m pip install -q --upgrade pip
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -v -E '^(numpy|pyarrow|fsspec)==' constraints.txt > "$constraints"
.venv-frameworks/bin/python -m pip install -q -c "$constraints" \
    -e '.[services,trainer,paddle-cpu,dev,paddleformers]'
echo "$want" > .venv-frameworks/.installed
