"""In pad, a padding batch holds its own rows, not the row group it was cut from.

The pyarrow reader's batches are views of their row group's columns. Padding kept such a view
for the rest of the epoch, and a rank with an empty shard received the donor's first batch
through ``torch.save``, which writes a view's whole storage: a 4-row padding batch held
16,000,000 bytes. Now padding is copied out once (``compacted``): each of its tensors owns
exactly its rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ddp_even import EvenLoader
from ddp_even.runtime.feed import compacted
from tests.helpers.spawn import run_ranks

BATCH = 64


def _owns_its_rows(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_compacted_copies_views_only() -> None:
    column = torch.arange(10_000, dtype=torch.float32)
    own = torch.arange(4)
    batch = {"x": column[100:104], "own": own, "names": ["a", "b"], "pair": (column[:2], 7)}
    kept = compacted(batch)
    assert torch.equal(kept["x"], column[100:104]) and _owns_its_rows(kept["x"])
    assert kept["own"] is own, "a tensor that owns its storage is not copied"
    assert kept["names"] == ["a", "b"] and kept["pair"][1] == 7
    assert _owns_its_rows(kept["pair"][0])


def _write(directory: Path, row_groups: list[int]) -> str:
    directory.mkdir(parents=True)
    start = 0
    with pq.ParquetWriter(
        str(directory / "part-0.parquet"), pa.schema([("id", pa.int64()), ("x", pa.float32())])
    ) as writer:
        for size in row_groups:
            ids = np.arange(start, start + size, dtype=np.int64)
            table = pa.table({"id": ids, "x": ids.astype(np.float32)})
            writer.write_table(table, row_group_size=size)
            start += size
    return directory.as_uri()


def _padding_of_each_rank(rank: int, world_size: int, urls: list[str]) -> list[dict[str, Any]]:
    seen = []
    for url in urls:
        loader = EvenLoader.from_parquet(url, BATCH, "pad")
        padding = own = 0
        owned = True
        ids: set[tuple[int, ...]] = set()
        for batch in loader:
            if loader.padding:
                padding += 1
                owned &= all(_owns_its_rows(batch[name]) for name in ("id", "x"))
                ids.add(tuple(batch["id"].tolist()))
            else:
                own += 1
        seen.append({"own": own, "padding": padding, "owned": owned, "kinds": len(ids)})
    return seen


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_padding_batches_hold_their_own_rows_on_every_rank(tmp_path: Path) -> None:
    # Round robin over 2 ranks: 2,048 + 512 rows gives rank 1 fewer batches (it pads with its
    # last one); one row group gives rank 1 none (it pads with rank 0's first batch).
    uneven = _write(tmp_path / "uneven", [2048, 512])
    one_group = _write(tmp_path / "one", [2048])
    ranks = run_ranks(_padding_of_each_rank, 2, [uneven, one_group], timeout=100)
    (uneven_0, one_0), (uneven_1, one_1) = ranks
    assert (uneven_0["own"], uneven_0["padding"]) == (32, 0)
    assert (uneven_1["own"], uneven_1["padding"]) == (8, 24)
    assert (one_0["own"], one_0["padding"]) == (32, 0)
    assert (one_1["own"], one_1["padding"]) == (0, 32)
    for padded in (uneven_1, one_1):
        assert padded["owned"], "a padding batch holds its rows, not its row group"
        assert padded["kinds"] == 1, "one batch, handed out again"
