#!/usr/bin/env bash
# Installs ddp_even (editable) with the given extras into .venv, created if missing, pinned by
# constraints.txt; pip prints its own progress (each download with its size).
#   bash scripts/install.sh petastorm        # what scripts/demo.sh needs
#   bash scripts/install.sh petastorm,dev    # and the test tools (scripts/test.sh)
# Skipped in a fraction of a second when .venv already has these extras from the same
# pyproject.toml, constraints.txt and checkout: .venv/.ddp-even-installed records them (delete
# it to install again).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras="${1:?usage: bash scripts/install.sh EXTRA[,EXTRA...]}"
stamp=.venv/.ddp-even-installed
# What an install follows from; the checkout's path too, since an editable install points there.
digest=$({ cat pyproject.toml constraints.txt; pwd; } | sha256sum | cut -d' ' -f1)

IFS=, read -ra wanted <<<"$extras"
missing=0
for extra in "${wanted[@]}"; do
    grep -qx "$digest $extra" "$stamp" 2>/dev/null || missing=1
done
if [[ -x .venv/bin/python && $missing -eq 0 ]]; then
    echo "ddp_even[$extras] is installed in .venv (pyproject.toml and constraints.txt unchanged)"
    exit 0
fi

if [[ ! -x .venv/bin/python ]]; then
    echo "Creating .venv with $(python3 --version)"
    python3 -m venv .venv
fi
# constraints.txt pins torch to the CPU wheel and the petastorm/pyarrow/numpy set that works
# (an open torch requirement would pull a CUDA build of several GB).
echo "Installing ddp_even[$extras] into .venv with pip (the first time: torch, pyspark and the rest)"
.venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e ".[$extras]"
# Extras installed earlier from the same files stay recorded; those of older files go.
{
    grep "^$digest " "$stamp" 2>/dev/null || true
    for extra in "${wanted[@]}"; do echo "$digest $extra"; done
} | sort -u >"$stamp.new"
mv "$stamp.new" "$stamp"
