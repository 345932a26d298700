"""A pytest plugin: the CPU time each test took, with every process it started.

``benchmarks/bench_suite.py`` loads it into each run (``-p benchmarks.suite_cpu``) with
``DDP_EVEN_SUITE_CPU_LOG`` naming a file; each test process (each xdist worker) then appends
one JSON line per test: its node id, the worker, when it ended, its wall time, and the CPU time
its process tree spent meanwhile. The tree is the test process and every process below it,
alive (their own CPU time) or ended and reaped by one of them (their parent's children's
time): a gloo rank forked by the fork server, a torchrun job's agent and workers, Spark's JVM.
Test processes run side by side, each counting only its own tree, so a test's CPU time does
not depend on what the others do, while its wall time does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator

import psutil
import pytest

LOG_VARIABLE = "DDP_EVEN_SUITE_CPU_LOG"


def tree_cpu_s(process: psutil.Process) -> float:
    """CPU seconds ``process`` and every process below it have spent, the reaped ones included."""
    total = 0.0
    try:
        tree = [process, *process.children(recursive=True)]
    except psutil.Error:
        tree = [process]
    for member in tree:
        try:
            times = member.cpu_times()
        except psutil.Error:  # ended meanwhile: its parent's children's time counts it
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    log = os.environ.get(LOG_VARIABLE)
    if not log:
        yield
        return
    this_process = psutil.Process()
    cpu_before, started = tree_cpu_s(this_process), time.perf_counter()
    yield
    line = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "ended": time.time(),
        "wall_s": time.perf_counter() - started,
        "cpu_s": tree_cpu_s(this_process) - cpu_before,
    }
    with open(log, "a") as file:  # one short write per line: the workers' lines stay whole
        file.write(json.dumps(line) + "\n")
