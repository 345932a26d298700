#!/usr/bin/env bash
# Installs ddp_even with its test tools into .venv (created if missing), then runs the
# linters, the type checker and the whole test suite. README's second set-up command; CI runs it.
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
.venv/bin/python -m pytest "$@"
