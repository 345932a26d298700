#!/usr/bin/env bash
# The README's first command: installs ddp_even into .venv (scripts/install.sh: skipped when
# nothing changed), then runs the demo,
#   python examples/train.py --demo --data demo-data
# which writes a small skewed Parquet dataset to demo-data/ (kept for what follows; ignored by
# git; reused when it is already there) and trains on 4 CPU ranks in each EvenLoader mode, and
# ends with three commands to try next. Extra arguments go to train.py (e.g. --epochs 5).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh petastorm
.venv/bin/python examples/train.py --demo --data demo-data "$@"

cat <<'NEXT'

Next, on the demo dataset in demo-data/:
  .venv/bin/ddp-even plan demo-data --world-size 4 --batch-size 16 --sharding rows
  .venv/bin/torchrun --nproc-per-node 2 examples/train.py --data demo-data --mode cycle --epochs 2
  bash scripts/test.sh --fast    # adds the test tools to .venv and runs the fast tests
NEXT
