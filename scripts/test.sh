#!/usr/bin/env bash
# Installs ddp_even with its test tools into .venv (created if missing), then runs the
# linters, the type checker, a short soak and the whole test suite. README's second set-up
# command; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# constraints.txt pins the one dependency set that works, each pin with its reason.
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[petastorm,dev]"

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The whole run starts with a short soak (docs/design.md, "Zero hangs under load"): the
# every-mode petastorm cases on 2 to 4 ranks beside a CPU hog and a disk hog, random pauses, a
# hard timeout per run. Arguments (a selection of tests) skip it.
if [[ $# -eq 0 ]]; then
    .venv/bin/python scripts/soak.py --minutes 3 --suite every-mode --hogs 1 --io-hogs 1
fi
.venv/bin/python -m pytest "$@"
