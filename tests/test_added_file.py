"""A file added to the dataset's directory after planning is a ``PlanMismatchError``.

A plan lists the dataset's files once. The pyarrow reader checked, at every pass, the footers
of the files it planned, not the directory: a file added since was ignored silently (its rows
never read, the epoch's lengths those of the old files). Now every pass lists the directory
again (:func:`ddp_even.parquet.metadata.changed_files`, called by ``changed_row_groups``) and
refuses to start when a data file was added or is gone, before any row is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from ddp_even import EvenLoader, PeerSourceError
from ddp_even.errors import PlanMismatchError
from ddp_even.parquet.metadata import changed_files, changed_row_groups, read_row_groups
from ddp_even.storage import resolve_dataset
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

SIZES = [[10, 30], [20, 20]]
BATCH = 4


def _add_file(directory: Path, name: str = "part-00002.parquet", rows: int = 12) -> Path:
    path = directory / name
    table = pq.read_table(directory / "part-00000.parquet").slice(0, rows)
    pq.write_table(table, path)
    return path


def test_a_file_added_since_planning_is_named(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    resolved = resolve_dataset(url)
    planned = read_row_groups(resolved)
    every_group = range(len(planned))
    assert changed_row_groups(resolved, planned, every_group) is None
    # Names planning skips, and a file without rows, change nothing.
    (tmp_path / "ds" / "_SUCCESS").write_text("")
    (tmp_path / "ds" / ".part-00000.parquet.crc").write_text("")
    # A file closed without a row group (a writer that wrote nothing), as planning skips it.
    pq.ParquetWriter(str(tmp_path / "ds" / "x.parquet"), pa.schema([("id", pa.int64())])).close()
    assert pq.read_metadata(tmp_path / "ds" / "x.parquet").num_row_groups == 0
    assert changed_row_groups(resolved, planned, every_group) is None
    added = _add_file(tmp_path / "ds")
    expected = f"{added} was added to the dataset after it was planned (1 new file)"
    assert changed_files(resolved, planned) == expected
    # Every rank's row groups: a new file changes every rank's share.
    assert changed_row_groups(resolved, planned, [0]) == expected
    assert changed_row_groups(resolved, planned, [3]) == expected


def test_a_file_gone_since_planning_is_named(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    resolved = resolve_dataset(url)
    planned = read_row_groups(resolved)
    (tmp_path / "ds" / "part-00001.parquet").unlink()
    assert changed_files(resolved, planned) == (
        f"{tmp_path / 'ds' / 'part-00001.parquet'} is gone from the dataset since it was planned"
    )


def test_a_list_of_files_has_no_other_files(tmp_path: Path) -> None:
    write_plain_dataset(tmp_path / "ds", SIZES)
    files = [str(tmp_path / "ds" / f"part-0000{index}.parquet") for index in range(2)]
    resolved = resolve_dataset(files)
    planned = read_row_groups(resolved)
    _add_file(tmp_path / "ds")
    assert changed_files(resolved, planned) is None


def train_two_epochs(rank: int, world_size: int, url: str, directory: str) -> dict[str, Any]:
    loader = EvenLoader.from_parquet(url, BATCH, "pad", sharding="rows")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    first = 0
    for batch in loader:
        model(batch["value"].reshape(-1, 1).float()).sum().backward()
        first += 1
    dist.barrier()
    if rank == 0:
        _add_file(Path(directory))
    dist.barrier()
    steps = 0
    try:
        for batch in loader:
            model(batch["value"].reshape(-1, 1).float()).sum().backward()
            steps += 1
    except (PlanMismatchError, PeerSourceError) as error:
        return {"first": first, "steps": steps, "error": type(error).__name__, "said": str(error)}
    return {"first": first, "steps": steps, "error": None, "said": ""}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_every_rank_stops_before_the_first_step_of_the_epoch_after_a_file_is_added(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    ranks = run_ranks(train_two_epochs, 2, url, str(tmp_path / "ds"), timeout=100)
    assert [rank["first"] for rank in ranks] == [10, 10], "the first epoch: 40 rows per rank"
    assert [rank["steps"] for rank in ranks] == [0, 0]
    for rank in ranks:
        assert "PlanMismatchError" in rank["error"] + rank["said"], rank
        assert "part-00002.parquet was added to the dataset after it was planned" in rank["said"]
