"""A dataset rewritten after it was planned: one clear error on every rank, before any step.

A plan counts each row group's rows once, from the footers. Every pass of a planned reader
reads the footers of its files again and refuses to start when one of its row groups no longer
has the rows the plan counted (a file rewritten in place), so no rank starts an epoch whose
lengths are wrong; the other ranks learn it at the epoch's agreement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from ddp_even import EvenLoader, PeerSourceError
from ddp_even.arrow.passes import make_shard_factory
from ddp_even.errors import PlanMismatchError
from ddp_even.parquet.metadata import changed_row_groups, read_row_groups
from ddp_even.storage import resolve_dataset
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

# sharding="rows" over 2 ranks: rank 0 reads part-00000 (10 + 30 rows), rank 1 part-00001.
SIZES = [[10, 30], [20, 20]]
BATCH = 4
ONE_READER = {"threads": 1}


def _rewrite_with_other_row_groups(path: Path) -> None:
    """The same file and number of row groups, other rows in each: 18 + 18 instead of 10 + 30."""
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 36), path, row_group_size=18)


@pytest.mark.timeout(60)
def test_a_file_rewritten_with_the_same_row_groups_is_named(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    resolved = resolve_dataset(url)
    planned = read_row_groups(resolved)
    assert changed_row_groups(resolved, planned, range(len(planned))) is None
    # Same rows in each row group, other values: a row predicate may keep other rows now.
    path = tmp_path / "ds" / "part-00001.parquet"
    table = pq.read_table(path)
    negated = table.set_column(1, "value", pc.negate(table["value"]))
    with pq.ParquetWriter(path, table.schema) as writer:
        for start in (0, 20):
            writer.write_table(negated.slice(start, 20), row_group_size=20)
    assert read_row_groups(resolved).num_rows.tolist() == planned.num_rows.tolist()
    assert changed_row_groups(resolved, planned, [0, 1]) is None, "rank 0's files are unchanged"
    assert changed_row_groups(resolved, planned, [2]) == (
        f"{path} was rewritten since it was planned (its footer changed)"
    )


@pytest.mark.timeout(60)
def test_a_pass_over_a_rewritten_file_is_refused_before_it_reads(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    plan, factory = make_shard_factory(url, 0, 2, BATCH, sharding="rows", loader_kwargs=ONE_READER)
    _, other = make_shard_factory(url, 1, 2, BATCH, sharding="rows", loader_kwargs=ONE_READER)
    assert plan.rows_per_rank == (40, 40)
    with factory() as shard_pass:
        assert sum(len(batch["id"]) for batch in shard_pass) == 40
    _rewrite_with_other_row_groups(tmp_path / "ds" / "part-00000.parquet")
    with pytest.raises(PlanMismatchError, match=r"part-00000.parquet #0\) has 18 rows now, the"):
        factory()
    # The other rank's files did not change: its passes still start.
    with other() as shard_pass:
        assert sum(len(batch["id"]) for batch in shard_pass) == 40


def train_after_a_rewrite(rank: int, world_size: int, url: str, path: str) -> dict[str, Any]:
    loader = EvenLoader.from_parquet(
        url, batch_size=BATCH, sharding="rows", mode="truncate", loader_kwargs=ONE_READER
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dist.barrier()
    if rank == 0:
        _rewrite_with_other_row_groups(Path(path))
    dist.barrier()
    steps = 0
    try:
        for batch in loader:
            model(batch["value"].reshape(-1, 1).float()).sum().backward()
            steps += 1
    except (PlanMismatchError, PeerSourceError) as error:
        return {"steps": steps, "error": type(error).__name__, "message": str(error)}
    return {"steps": steps, "error": None, "message": ""}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_every_rank_stops_before_the_first_step_when_a_planned_file_changed(
    tmp_path: Path,
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    path = str(tmp_path / "ds" / "part-00000.parquet")
    first, second = run_ranks(train_after_a_rewrite, 2, url, path, timeout=100)
    assert (first["steps"], first["error"]) == (0, "PlanMismatchError")
    assert "has 18 rows now, the plan counted 10" in first["message"]
    assert (second["steps"], second["error"]) == (0, "PeerSourceError")
    assert second["message"].startswith("rank 0's data source raised PlanMismatchError: ")
