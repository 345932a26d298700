#!/usr/bin/env bash
# Installs ddp_even (editable) with the given extras into a virtual environment, created if
# missing, pinned by a constraints file; pip prints its own progress (each download with its
# size). By default .venv and constraints.txt (petastorm's dependency set); DDP_EVEN_VENV and
# DDP_EVEN_CONSTRAINTS name others (scripts/test.sh --latest: .venv-latest and
# constraints-latest.txt, today's numpy and pyarrow without petastorm).
#   bash scripts/install.sh petastorm        # what scripts/demo.sh needs
#   bash scripts/install.sh petastorm,dev    # and the test tools (scripts/test.sh)
# Skipped in a fraction of a second when the environment already has these extras from the
# same pyproject.toml, constraints file and checkout: VENV/.ddp-even-installed records them
# (delete it to install again).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras="${1:?usage: bash scripts/install.sh EXTRA[,EXTRA...]}"
venv="${DDP_EVEN_VENV:-.venv}"
constraints="${DDP_EVEN_CONSTRAINTS:-constraints.txt}"
stamp="$venv/.ddp-even-installed"
# What an install follows from; the checkout's path too, since an editable install points there.
digest=$({ cat pyproject.toml "$constraints"; pwd; } | sha256sum | cut -d' ' -f1)

IFS=, read -ra wanted <<<"$extras"
missing=0
for extra in "${wanted[@]}"; do
    grep -qx "$digest $extra" "$stamp" 2>/dev/null || missing=1
done
if [[ -x "$venv/bin/python" && $missing -eq 0 ]]; then
    echo "ddp_even[$extras] is installed in $venv (pyproject.toml and $constraints unchanged)"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "Creating $venv with $(python3 --version)"
    python3 -m venv "$venv"
fi
# The constraints pin torch to the CPU wheel (an open torch requirement would pull a CUDA build
# of several GB) and the pyarrow/numpy set that works.
echo "Installing ddp_even[$extras] into $venv with pip, pinned by $constraints (the first time: torch and the rest)"
"$venv/bin/python" -m pip install --disable-pip-version-check -c "$constraints" -e ".[$extras]"
# Extras installed earlier from the same files stay recorded; those of older files go.
{
    grep "^$digest " "$stamp" 2>/dev/null || true
    for extra in "${wanted[@]}"; do echo "$digest $extra"; done
} | sort -u >"$stamp.new"
mv "$stamp.new" "$stamp"
