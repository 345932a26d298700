#!/usr/bin/env bash
# The README's first command: set up .venv (first run only) and run the demo,
#   python examples/train.py --demo
# which writes a small skewed Parquet dataset to a temporary directory and trains on 4 CPU
# ranks in each EvenLoader mode. Extra arguments go to train.py (e.g. --epochs 5).
# Safe to run again: pip only checks the installed set when nothing changed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x .venv/bin/python ]]; then
    echo "Creating .venv with $(python3 --version)"
    python3 -m venv .venv
fi

# constraints.txt pins torch to the CPU wheel and the petastorm/pyarrow/numpy set that works
# (an open torch requirement would pull a CUDA build of several GB).
echo "Installing ddp_even with the petastorm extra into .venv (quick when already done)"
.venv/bin/pip install --quiet -c constraints.txt -e ".[petastorm]"

exec .venv/bin/python examples/train.py --demo "$@"
