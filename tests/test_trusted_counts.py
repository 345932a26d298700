"""Counts ddp_even reuses are checked against what they describe, or are never trusted blindly.

Each case below was reproduced on 0.2 as a one-rank failure mid-epoch or as rows skipped or
trained twice without a word; each now ends in the uninterrupted run's exact batches, a
recomputation, or the same clear error on every rank before the first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank

# 17 rows: "rows" sharding gives rank 0 rows 0-7 (2 batches of 4) and rank 1 rows 8-16 (3).
SIZES = [[5, 6], [6]]
BATCH = 4


def _ids(batch: Any) -> list[int]:
    return [int(value) for value in batch["id"]]


def _cycle_resumed_after_a_ranks_last_own_batch(
    rank: int, world_size: int, url: str, sync_every: int | None
) -> dict[str, Any]:
    from ddp_even import EvenLoader

    def loader() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            "cycle",
            sharding="rows",
            sync_every=sync_every,
            reader_kwargs={"seed": 3, "workers_count": 2},
        )

    torch.manual_seed(0)
    whole = [_ids(batch) for batch in loader()]
    stopped = loader()
    state = None
    for step, _ in enumerate(stopped, start=1):
        if step == 2:  # rank 0 has just handed out its own last batch
            state = stopped.state_dict()
            break
    resumed = loader()
    assert state is not None
    resumed.load_state_dict(state)
    rest = [_ids(batch) for batch in resumed]
    return {"whole": whole, "rest": rest, "stats": resumed.stats.as_dict()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync_every", [None, 1], ids=["known-lengths", "every-step"])
def test_cycle_resumes_right_after_a_ranks_last_own_batch(
    tmp_path: Path, sync_every: int | None
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    results = run_ranks(
        _cycle_resumed_after_a_ranks_last_own_batch, 2, url, sync_every, timeout=200
    )
    for rank, result in enumerate(results):
        assert len(result["whole"]) == 3, "cycle runs the longest shard's 3 steps"
        assert result["rest"] == result["whole"][2:], (rank, result)
    assert results[0]["stats"]["repeated_batches"] == (1, 0)
    assert results[0]["stats"]["resumed_at_step"] == 2


# --- a state loaded into a loader of other data or another reading order (cases 2 and 7) ----


def _state_loaded_elsewhere(
    rank: int, world_size: int, url: str, other_url: str, change: str
) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.predicates import in_lambda
    from petastorm.pytorch import BatchedDataLoader

    from ddp_even import EvenLoader

    def planned(url: str, **reader_kwargs: Any) -> EvenLoader[Any]:
        return EvenLoader.from_parquet(
            url,
            BATCH,
            "truncate",
            sharding="rows",
            reader_kwargs={"seed": 3, "workers_count": 2, **reader_kwargs},
        )

    def footers(batch_size: int) -> EvenLoader[Any]:
        def one_pass() -> Any:
            reader = make_batch_reader(
                url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2
            )
            return BatchedDataLoader(reader, batch_size=batch_size)

        return EvenLoader(one_pass, "truncate")

    keep_all = in_lambda(["id"], lambda ids: ids >= 0)
    keep_all_too = in_lambda(["id"], lambda ids: ids > -1)
    saved_by, loaded_by = {
        "seed": (lambda: planned(url), lambda: planned(url, seed=4)),
        "predicate": (
            lambda: planned(url, predicate=keep_all),
            lambda: planned(url, predicate=keep_all_too),
        ),
        "data": (lambda: planned(url), lambda: planned(other_url)),
        "batch_size": (lambda: footers(BATCH), lambda: footers(2 * BATCH)),
    }[change]
    stopped = saved_by()
    state = None
    for step, _ in enumerate(stopped, start=1):
        if step == 1:
            state = stopped.state_dict()
            break
    resumed = loaded_by()
    trained: list[list[int]] = []
    try:
        assert state is not None
        resumed.load_state_dict(state)
        trained = [_ids(batch) for batch in resumed]
    except ValueError as error:
        return {"error": str(error), "trained": trained}
    return {"error": None, "trained": trained}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change", ["seed", "predicate", "data", "batch_size"])
def test_a_state_of_other_data_or_order_is_refused_on_every_rank_naming_what_differs(
    tmp_path: Path, change: str
) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    # The same row-group sizes, other rows: the plan alone cannot tell the two apart.
    other_url = write_plain_dataset(tmp_path / "other", SIZES, partition_by=None)
    Path(other_url.removeprefix("file://"), "part-00001.parquet").rename(
        Path(other_url.removeprefix("file://"), "part-00001b.parquet")
    )
    results = run_ranks(_state_loaded_elsewhere, 2, url, other_url, change, timeout=250)
    for result in results:
        assert result["trained"] == [], "refused before any step"
        assert result["error"] is not None, result
        assert f"whose {change} differs" in result["error"]
