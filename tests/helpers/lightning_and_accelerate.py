"""Run the trainer examples (Lightning, accelerate) as real jobs and read what each rank wrote.

``write_regression_dataset`` writes the columns the examples read (float ``x0..x3`` and
``label``) with the given row-group sizes; ``expected_epoch`` works out, from those sizes alone,
what every rank's ``EpochStats`` must say (petastorm's round robin gives rank ``r`` the row
groups ``i`` with ``i % world_size == r``; a ``BatchedDataLoader`` cuts a shard into full
batches and one short last batch). In share, which batches travel is the plan's choice: the
batch counts follow from share's promises, and ``check_share_rows`` checks the rows against
them (every row once, padding only at the last step). ``launch`` runs a command in its own
session with a hard timeout, waits for the per-rank JSON files, and kills whatever is left of
the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.datasets import shard_rows

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
FEATURES = ("x0", "x1", "x2", "x3")
# The examples' --source choices this environment runs (examples/shard_loaders.py): from_parquet
# (pyarrow's reader) everywhere, the factory of petastorm loaders where petastorm is installed.
PETASTORM_INSTALLED = importlib.util.find_spec("petastorm") is not None
SOURCES = ("factory", "parquet") if PETASTORM_INSTALLED else ("parquet",)


def source_runs(modes: Sequence[str]) -> list[Any]:
    """``(mode, source)`` for every mode and source, as parameters; those that read with
    petastorm marked so."""
    return [
        pytest.param(mode, source, marks=() if source == "parquet" else pytest.mark.petastorm)
        for mode in modes
        for source in SOURCES
    ]


def planned(mode: str, source: str) -> bool:
    """Whether a run's statistics know what each rank dropped: ``from_parquet`` plans, and a
    petastorm factory sharded with cur_shard/shard_count has footer-known lengths too (share
    plans its hand-over from them), except in join mode."""
    return source != "factory" or mode != "join"


def skip_without(trainer: str) -> None:
    """Skip the test when the optional trainer ``trainer`` (``"lightning"``, ``"accelerate"``) is
    not installed (``pytest.importorskip``), except under CI (``CI`` set): CI installs every
    trainer (the ``dev`` extra), so there a missing one fails instead of passing unseen."""
    if os.environ.get("CI"):
        __import__(trainer)
    else:
        pytest.importorskip(trainer)


# Launcher variables a test run may have inherited; each job sets its own.
_LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DDP_EVEN_LIGHTNING_DEMO_DATA",
)


def write_regression_dataset(directory: Path, row_group_sizes: Sequence[int]) -> str:
    """One Parquet file with one row group per size; returns its directory's ``file://`` URL."""
    rows = sum(row_group_sizes)
    rng = np.random.default_rng(7)
    features = rng.standard_normal((rows, len(FEATURES))).astype(np.float32)
    columns: dict[str, Any] = {name: features[:, i] for i, name in enumerate(FEATURES)}
    columns["label"] = features.sum(axis=1) + np.float32(0.5)
    table = pa.table(columns)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "part-00000.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        start = 0
        for size in row_group_sizes:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    written = pq.read_metadata(path)
    assert [written.row_group(i).num_rows for i in range(written.num_row_groups)] == list(
        row_group_sizes
    )
    return directory.resolve().as_uri()


def shard_batches(
    row_group_sizes: Sequence[int], world_size: int, batch_size: int
) -> list[list[int]]:
    """Per rank, the sizes of the batches of one pass over its shard."""
    batches = []
    for rank in range(world_size):
        rows = shard_rows(list(row_group_sizes), world_size, rank)
        full, rest = divmod(rows, batch_size)
        batches.append([batch_size] * full + ([rest] if rest else []))
    return batches


def expected_epoch(
    mode: str,
    row_group_sizes: Sequence[int],
    world_size: int,
    batch_size: int,
    *,
    planned: bool,
) -> dict[str, Any]:
    """The fields of every epoch's ``EpochStats.as_dict()`` (tuples as lists, as JSON has them)."""
    batches = shard_batches(row_group_sizes, world_size, batch_size)
    counts = [len(shard) for shard in batches]
    if mode == "share":
        return _expected_share_epoch(counts, planned=planned)
    if mode == "truncate":
        steps = [min(counts)] * world_size
    elif mode in ("cycle", "pad"):
        steps = [max(counts)] * world_size
    else:
        steps = counts
    own = [min(taken, count) for taken, count in zip(steps, counts, strict=True)]
    extra = [taken - mine for taken, mine in zip(steps, own, strict=True)]
    # What a rank hands out past its data: its shard again (cycle), or its last batch (pad).
    if mode == "pad":
        handed = [shard + [shard[-1]] * more for shard, more in zip(batches, extra, strict=True)]
    else:
        handed = [
            [shard[i % len(shard)] for i in range(taken)]
            for taken, shard in zip(steps, batches, strict=True)
        ]
    expected: dict[str, Any] = {
        "mode": mode,
        "world_size": world_size,
        "steps": steps,
        "own_batches": own,
        "repeated_batches": [0] * world_size if mode == "pad" else extra,
        "passes": [
            1 if mode == "pad" else -(-taken // count)
            for taken, count in zip(steps, counts, strict=True)
        ],
        "samples": [sum(rows) for rows in handed],
        "truncated": [count > taken for taken, count in zip(steps, counts, strict=True)],
        "padded_batches": extra if mode == "pad" else [0] * world_size,
        "padded_rows": [
            sum(rows[mine:]) if mode == "pad" else 0 for rows, mine in zip(handed, own, strict=True)
        ],
        **_no_hand_over(world_size),
    }
    if planned:
        expected["dropped_batches"] = [
            count - mine for count, mine in zip(counts, own, strict=True)
        ]
        expected["dropped_rows"] = [
            sum(shard) - sum(shard[:mine]) for shard, mine in zip(batches, own, strict=True)
        ]
    _add_plan_fields(expected, world_size, planned=planned)
    own_total = sum(own)
    expected["oversampling"] = sum(expected["repeated_batches"]) / own_total if own_total else 0.0
    return expected


def _no_hand_over(world_size: int) -> dict[str, list[int]]:
    names = ("sent_batches", "sent_rows", "received_batches", "received_rows")
    return {name: [0] * world_size for name in names}


def _add_plan_fields(expected: dict[str, Any], world_size: int, *, planned: bool) -> None:
    if planned:
        expected.setdefault("dropped_batches", [0] * world_size)
        expected.setdefault("dropped_rows", [0] * world_size)
        expected["lost_rows"] = [0] * world_size
        # from_parquet's default, and what petastorm's cur_shard/shard_count does.
        expected["sharding"] = "round_robin"
    else:
        expected["dropped_batches"] = expected["dropped_rows"] = expected["lost_rows"] = None
        expected["sharding"] = None


def _expected_share_epoch(counts: Sequence[int], *, planned: bool) -> dict[str, Any]:
    """Share's batch counts, from what it promises: every rank takes ceil(B / W) steps; a rank
    with at least that many batches hands out that many of its own and sends the rest; a rank
    with fewer hands out all of its own and receives the others' batches, except that the
    W * steps - B ranks with the fewest batches (the shards here differ in size) pad the last
    step. Nothing is dropped or repeated. The rows: ``check_share_rows``."""
    world_size, total = len(counts), sum(counts)
    steps = -(-total // world_size)
    own = [min(count, steps) for count in counts]
    padding = world_size * steps - total
    padded_ranks = sorted(range(world_size), key=lambda rank: counts[rank])[:padding]
    padded = [int(rank in padded_ranks) for rank in range(world_size)]
    expected: dict[str, Any] = {
        "mode": "share",
        "world_size": world_size,
        "steps": [steps] * world_size,
        "own_batches": own,
        "repeated_batches": [0] * world_size,
        "passes": [1] * world_size,
        "truncated": [False] * world_size,
        "padded_batches": padded,
        "sent_batches": [count - mine for count, mine in zip(counts, own, strict=True)],
        "received_batches": [steps - mine - pad for mine, pad in zip(own, padded, strict=True)],
        "oversampling": 0.0,
    }
    _add_plan_fields(expected, world_size, planned=planned)
    return expected


def check_share_rows(
    epoch: dict[str, Any], row_group_sizes: Sequence[int], world_size: int, batch_size: int
) -> None:
    """One share epoch's rows: each rank hands out its shard's rows less those it sent, plus
    those it received and its padding; what is sent is received; a padding batch is a copy of
    a batch of the dataset; so the real rows handed out are the dataset's, once."""
    batches = shard_batches(row_group_sizes, world_size, batch_size)
    for rank, shard in enumerate(batches):
        handed = sum(shard) - epoch["sent_rows"][rank] + epoch["received_rows"][rank]
        assert epoch["samples"][rank] == handed + epoch["padded_rows"][rank], f"rank {rank}"
        assert (epoch["padded_batches"][rank] == 0) == (epoch["padded_rows"][rank] == 0)
    assert sum(epoch["sent_rows"]) == sum(epoch["received_rows"])
    sizes = {size for shard in batches for size in shard}
    assert all(rows in sizes | {0} for rows in epoch["padded_rows"]), epoch["padded_rows"]
    real = sum(epoch["samples"]) - sum(epoch["padded_rows"])
    assert real == sum(row_group_sizes)


def launch(
    command: Sequence[str],
    results: Path,
    expected_files: Sequence[str],
    *,
    timeout: float,
    cwd: Path,
) -> str:
    """Run ``command`` until it exits and every expected file is in ``results``; its output.

    The job runs in a session of its own, killed whole at the end (Lightning's ranks 1..N-1 are
    children that outlive rank 0 by a moment). Raises ``AssertionError`` with the output's tail
    when the time runs out or a file is missing.
    """
    env = {name: value for name, value in os.environ.items() if name not in _LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_path = cwd / "job.log"
    deadline = time.monotonic() + timeout
    with log_path.open("wb") as log:
        job = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=max(deadline - time.monotonic(), 0.1))
            while time.monotonic() < deadline and not all(
                (results / name).exists() for name in expected_files
            ):
                time.sleep(0.1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = log_path.read_text(errors="replace")
    missing = [name for name in expected_files if not (results / name).exists()]
    assert not missing, (
        f"after {timeout:.0f} s (exit status {job.returncode}) no {missing}; "
        f"output:\n{output[-6000:]}"
    )
    return output


def read_ranks(results: Path, name: str, world_size: int) -> list[dict[str, Any]]:
    """The JSON each rank wrote for the run ``name`` (``<name>-rank<r>.json``), rank 0 first."""
    return [
        json.loads((results / f"{name}-rank{rank}.json").read_text()) for rank in range(world_size)
    ]
