"""bench_scale's Parquet phase: every mode over planned shards of one dataset, and a resume.

The dataset (:func:`write_dataset`): one file of ``2 W + 3`` row groups of 8 to 20 rows, so
that round robin gives ranks two or three row groups of different sizes; columns ``id`` (the
row's number) and ``x``. Every rank reads it with from_parquet's reader (row
groups shuffled with a seed), batches of 4 rows, sharded round robin and by equal row ranges,
one epoch in each mode (:func:`measure_parquet`); then a truncate epoch of round-robin shards
left after 2 steps with the ``state_dict()`` saved there and resumed in a new loader.
:func:`check_parquet` holds the results to each mode's definition: truncate, cycle and pad
take the same number of steps on every rank, join each rank its own; pad and join hand out
every row exactly once (padding left out), truncate none twice; the resumed epoch's batches
are the uninterrupted epoch's.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_even.names import ModeName, Sharding

MODES: tuple[ModeName, ...] = ("truncate", "cycle", "pad", "join")
SHARDINGS: tuple[Sharding, ...] = ("round_robin", "rows")
BATCH_SIZE = 4
# Row groups shuffled with a seed: the order a resume computes (docs/resume.md).
SEED = 7
RESUME_AFTER = 2


def row_group_sizes(world_size: int) -> list[int]:
    return [8 + (index * 7) % 13 for index in range(2 * world_size + 3)]


def write_dataset(folder: Path, world_size: int) -> Path:
    """The dataset for ``world_size`` ranks, written to ``folder``; its file's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "scale.parquet"
    first = 0
    schema = pa.schema([("id", pa.int64()), ("x", pa.float32())])
    with pq.ParquetWriter(path, schema) as writer:
        for size in row_group_sizes(world_size):
            ids = list(range(first, first + size))
            writer.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}, schema=schema))
            first += size
    return path


def _epoch_ids(
    loader: Any, train_step: Callable[[Any], None], stop_after: int | None = None
) -> tuple[list[list[int]], int, Any]:
    """The ids of each real batch of one epoch (padding left out), the steps taken, and with
    ``stop_after`` the state saved at that step, inside the loop (docs/resume.md)."""
    batches, steps, state = [], 0, None
    for batch in loader:
        train_step(batch["x"].reshape(-1, 1))
        steps += 1
        if not loader.padding:
            batches.append(batch["id"].tolist())
        if steps == stop_after:
            state = loader.state_dict()
            break
    return batches, steps, state


def measure_parquet(
    path: Path, train_step: Callable[[Any], None], joinables: list[Any], timeout: float
) -> dict[str, Any]:
    """Every mode and sharding, then the resume, on this rank: ids and steps of each epoch,
    each batch's ``x`` given to ``train_step`` (join mode's ``joinables`` train there)."""
    from ddp_even import EvenLoader

    def loader(mode: ModeName, sharding: Sharding) -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            str(path), BATCH_SIZE, mode, sharding=sharding, timeout=timeout,
            joinables=joinables if mode == "join" else (), reader_kwargs={"seed": SEED},
        )  # fmt: skip

    epochs: dict[str, Any] = {}
    for sharding in SHARDINGS:
        for mode in MODES:
            batches, steps, _ = _epoch_ids(loader(mode, sharding), train_step)
            epochs[f"{sharding} {mode}"] = {"batches": batches, "steps": steps}

    left = loader("truncate", "round_robin")
    before, _, state = _epoch_ids(left, train_step, stop_after=RESUME_AFTER)
    resumed = loader("truncate", "round_robin")
    resumed.load_state_dict(state)
    after, _, _ = _epoch_ids(resumed, train_step)
    return {"epochs": epochs, "resumed": before + after}


def check_parquet(results: list[dict[str, Any]], world_size: int) -> list[str]:
    """What in the ranks' results (in rank order) breaks a mode's definition; [] if nothing."""
    every_row = collections.Counter(range(sum(row_group_sizes(world_size))))
    wrong = []
    for sharding in SHARDINGS:
        for mode in MODES:
            name = f"{sharding} {mode}"
            epochs = [result["parquet"]["epochs"][name] for result in results]
            steps = [epoch["steps"] for epoch in epochs]
            rows = collections.Counter(
                row for epoch in epochs for batch in epoch["batches"] for row in batch
            )
            if mode == "join":
                if steps != [len(epoch["batches"]) for epoch in epochs]:
                    wrong.append(f"{name}: a rank's steps are not its own batches")
            elif len(set(steps)) != 1:
                wrong.append(f"{name}: unequal steps {sorted(set(steps))}")
            if mode in ("pad", "join") and rows != every_row:
                wrong.append(f"{name}: not every row exactly once")
            if mode == "truncate" and max(rows.values()) != 1:
                wrong.append(f"{name}: a row handed out twice")
    for rank, result in enumerate(results):
        uninterrupted = result["parquet"]["epochs"]["round_robin truncate"]["batches"]
        if result["parquet"]["resumed"] != uninterrupted:
            wrong.append(f"rank {rank}: the resumed epoch differs from the uninterrupted one")
    return wrong
