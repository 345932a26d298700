#!/usr/bin/env bash
# Installs ddp_even with its test tools (scripts/install.sh: skipped when nothing changed),
# then tests. README's set-up commands; CI runs it, then `--latest`, without other arguments.
#   bash scripts/test.sh                  .venv, petastorm's dependency set (constraints.txt):
#                                         ruff, mypy, a short soak, then every test: the fast
#                                         ones as --fast runs them, the multi-rank and Spark
#                                         ones also in 3 processes, then the timing ones apart,
#                                         in 4, then the benchmarks' smoke runs (marked
#                                         benchmark), in 2
#   bash scripts/test.sh --latest         .venv-latest, today's numpy and pyarrow without
#                                         petastorm (constraints-latest.txt): every test that
#                                         does not need petastorm (or Spark), but for the
#                                         timing and in_memory ones (see below), the same tiers
#   bash scripts/test.sh --fast [ARGS]    only the fast tests (no multi-rank jobs, no Spark), in
#                                         3 processes (on 2 cores: many tests wait on a server
#                                         or a subprocess; benchmarks/bench_suite.py)
#   bash scripts/test.sh ARGS             ruff, mypy, then pytest ARGS (a selection of tests)
#   bash scripts/test.sh [--latest] --install   only the install (.ci/run: both side by side)
set -euo pipefail
cd "$(dirname "$0")/.."

# Python's default, even where PYTHONDONTWRITEBYTECODE is set: bytecode written beside the
# sources (ignored by git). pytest rewrites the asserts of every test module, about 3 s of each
# test process's start, and would otherwise do it again on every run.
unset PYTHONDONTWRITEBYTECODE

if [[ ${1:-} == --latest ]]; then
    shift
    # recipes: Ray and Hugging Face datasets (docs/stacks.md), which need this set's numpy 2.
    DDP_EVEN_VENV=.venv-latest DDP_EVEN_CONSTRAINTS=constraints-latest.txt \
        bash scripts/install.sh dev,recipes
    python=.venv-latest/bin/python
    # petastorm 0.12.1 as a user gets it beside pyarrow 26 (pip allows it), in a directory of
    # its own that only tests/test_petastorm_beside_pyarrow_26.py puts on a subprocess's
    # PYTHONPATH: this environment itself stays without petastorm. No dependencies but the two
    # petastorm imports before it fails on pyarrow.filesystem (as it does with all of them).
    beside=.venv-latest/petastorm-0.12.1-beside
    if [[ ! -f $beside/.installed ]]; then
        rm -rf "$beside"
        "$python" -m pip install --disable-pip-version-check --quiet --no-deps --target "$beside" \
            petastorm==0.12.1 future==1.0.0 diskcache==5.6.3
        touch "$beside/.installed"
    fi
    # The tests petastorm or Spark need are deselected: this set has neither.
    lane="not petastorm and not spark"
else
    bash scripts/install.sh petastorm,dev
    python=.venv/bin/python
    lane=""
fi
if [[ ${1:-} == --install ]]; then
    exit
fi

in_processes() {
    # loadgroup: the tests of the local S3 server share one process, and so one server; so do
    # those of the local Spark session.
    local workers=$1 selected=$2
    shift 2
    "$python" -m pytest -n "$workers" --dist loadgroup -m "${lane:+($lane) and }$selected" "$@"
}
fast_tests() {
    in_processes 3 "not multirank and not spark and not benchmark" "$@"
}
if [[ ${1:-} == --fast ]]; then
    shift
    fast_tests "$@"
    exit
fi
if [[ -z $lane ]]; then
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
fi
if [[ $# -gt 0 ]]; then
    exec "$python" -m pytest ${lane:+-m "$lane"} "$@"
fi
# The whole run starts with a short soak (docs/performance.md, "Soak"): the
# every-mode petastorm cases beside a CPU hog and a disk hog, random pauses, a hard timeout per
# run; three runs, on 2, 3 and 4 ranks (about 70 s). It is a sample of what the long soak
# (CONTRIBUTING.md, "Soak") proves, and a check that the soak itself still runs: the 22
# runs of its three minutes in three clean-clone CI runs found nothing. Arguments (a selection
# of tests) skip it; so does the lane without petastorm. Its third run is that test on 4 ranks
# as the multi-rank tier runs it, with the pauses added: the tier leaves it out (16 s of CPU).
soaked=()
if [[ -z $lane ]]; then
    "$python" scripts/soak.py --runs 3 --suite every-mode --hogs 1 --io-hogs 1
    soaked=(--deselect tests/test_petastorm.py::test_petastorm_loaders_in_every_mode)
fi
# Every test, in three runs. The fast ones in 3 processes (73 s in one process, 42 s in 3, the
# same hour). Those that start ranks or use Spark also in 3 (667 s in one process, 508 s in 3,
# the same morning: both cores busy, with the processes the tests start, much of it importing
# torch; CONTRIBUTING.md, "Set-up and the test run"), but for the timing ones, which bound
# in seconds how soon a fault is named: beside the other jobs on 2 cores the machine's
# contention would set that time, so they run last, by themselves. There they wait rather than
# compute (a quarter of the machine in 4 processes), so they run in 4: each test's time and
# each fault's margin to its bound measured the same as in one (357 s; 136 s in 3, 112 s in 4).
# All three run even if one fails. Then, once (in the main lane), the benchmarks' smoke runs:
# they check that each benchmark still runs end to end, not the library; beside them the tests
# that load the machine on purpose (marked load: a CPU hog, 16 ranks), which bound no time and
# beside the timing tests made one of those miss its bound.
#
# The lane on today's numpy and pyarrow leaves out the timing tests and those marked in_memory
# (in the main lane the timing tier takes about 145 s, and the in_memory tests 150 s of CPU with
# the ranks they start: on 2 cores, about 75 s). What differs between the lanes is numpy and
# pyarrow (torch is the same wheel in both): these tests train on in-memory lists of ints, or on
# nothing (the test kit's own ranks), and what they check (the protocol, every mode's steps,
# faults, heartbeats, the TCP store, gloo, a process's exit, misuse) never reaches pyarrow; the
# one numpy path they take, the agreement's encoding, every other multi-rank test of that lane
# takes too (and tests/test_agreement_forms.py both of its forms). Every other test runs in
# both lanes.
if [[ -n $lane ]]; then
    lane="$lane and not in_memory"
fi
status=0
fast_tests || status=$?
in_processes 3 "(multirank or spark) and not timing and not benchmark and not load" "${soaked[@]}" ||
    status=$?
if [[ -z $lane ]]; then
    in_processes 4 "timing and (multirank or spark) and not benchmark and not load" || status=$?
    in_processes 2 "benchmark or load" || status=$?
fi
exit "$status"
