"""Resuming the loop users already have, ``EvenLoader(lambda: BatchedDataLoader(
make_batch_reader(url, ...)))``, into a loop built otherwise is refused, not silently wrong.

A saved state records what the epoch's first pass was built from (the files and their
footers, the reader's seed, shuffles, predicate, transform, fields and shard, the loader and
its batch size), read from the real petastorm reader; a resume into a loop that differs in any
of them, or that cannot tell, raises :class:`~ddp_even.StateMismatchError` naming it before
any batch of the resumed epoch. One process, real Parquet files, real petastorm readers; the
same on several ranks, in every mode and with process pools, is in
``tests/test_wrapped_loop.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from ddp_even import EvenLoader, StateMismatchError
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.logs import ddp_even_messages

pytestmark = pytest.mark.petastorm

SIZES = [10] * 6
BATCH = 4
STOP = 3


def _keep_all(ids: Any) -> Any:
    return ids >= 0


def _unchanged(frame: Any) -> Any:
    return frame


def _factory(url: str, change: str, other: str) -> Any:
    """The loop of the saved state (``change="none"``), or one that differs in ``change``."""
    from petastorm import TransformSpec, make_batch_reader
    from petastorm.predicates import in_lambda
    from petastorm.pytorch import BatchedDataLoader, DataLoader

    options: dict[str, Any] = {
        "num_epochs": 1,
        "seed": 1,
        "shuffle_row_groups": True,
        "workers_count": 1,
        "cur_shard": 0,
        "shard_count": 2,
    }
    batch_size, loader_class, dataset = BATCH, BatchedDataLoader, url
    if change == "seed":
        options["seed"] = 2
    elif change == "data":
        dataset = other  # the same row-group sizes, other files
    elif change == "batch_size":
        batch_size = 2 * BATCH
    elif change == "batch_size and transform_spec":  # lengths unknown: no footer plan
        batch_size = 2 * BATCH
        options["transform_spec"] = TransformSpec(_unchanged)
    elif change == "transform_spec":
        options["transform_spec"] = TransformSpec(_unchanged)
    elif change == "predicate":
        options["predicate"] = in_lambda(["id"], _keep_all)
    elif change == "schema_fields":
        options["schema_fields"] = ["id", "value"]
    elif change == "shuffle_row_groups":
        options["shuffle_row_groups"] = False
    elif change == "shard":
        options["cur_shard"] = 1
    elif change == "loader":
        loader_class = DataLoader
    else:
        assert change == "none", change

    def one_pass() -> Any:
        return loader_class(make_batch_reader(dataset, **options), batch_size=batch_size)

    return one_pass


#: Each change, and the parts of the state's provenance that must be named.
CHANGES = {
    "seed": {"seed"},
    "data": {"data"},
    "batch_size": {"batch_size"},
    "batch_size and transform_spec": {"batch_size", "transform_spec"},
    "transform_spec": {"transform_spec"},
    "predicate": {"predicate"},
    "schema_fields": {"schema_fields"},
    "shuffle_row_groups": {"shuffle_row_groups"},
    "shard": {"shard"},
    "loader": {"loader"},
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("wrapped-resume")
    return write_plain_dataset(root / "a", SIZES), write_plain_dataset(root / "b", SIZES)


def _ids(batch: Any) -> list[int]:
    return [int(value) for value in batch["id"]]


def _saved_state(url: str, other: str) -> tuple[dict[str, Any], list[list[int]]]:
    """The state after ``STOP`` steps of the base loop, and its uninterrupted epoch."""
    whole = [_ids(batch) for batch in EvenLoader(_factory(url, "none", other))]
    stopped = EvenLoader(_factory(url, "none", other))
    epoch = iter(stopped)
    assert [_ids(next(epoch)) for _ in range(STOP)] == whole[:STOP]
    state = stopped.state_dict()
    del epoch
    return state, whole


@pytest.mark.timeout(120)
def test_a_resume_into_the_same_loop_is_the_uninterrupted_epoch(datasets: tuple[str, str]) -> None:
    state, whole = _saved_state(*datasets)
    assert {"data", "seed", "shard", "batch_size", "transform_spec"} <= set(state["provenance"])
    resumed = EvenLoader(_factory(datasets[0], "none", datasets[1]))
    resumed.load_state_dict(state)
    assert [_ids(batch) for batch in resumed] == whole[STOP:]
    assert resumed.stats.steps == (len(whole),) and resumed.stats.resumed_at_step == STOP


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_into_a_loop_built_otherwise_is_refused_naming_what_differs(
    datasets: tuple[str, str], change: str
) -> None:
    url, other = datasets
    state, _ = _saved_state(url, other)
    resumed = EvenLoader(_factory(url, change, other))
    resumed.load_state_dict(state)
    handed_out = []
    with pytest.raises(StateMismatchError) as refused:
        for batch in resumed:
            handed_out.append(batch)
    assert handed_out == [], "refused before the first step"
    assert set(refused.value.differ) == CHANGES[change], str(refused.value)
    assert refused.value.untold == {}
    assert "strict=False" in str(refused.value)
    # The refused epoch is over; the next one starts clean, in the new loop's settings.
    assert len([_ids(batch) for batch in resumed]) > 0


@pytest.mark.timeout(120)
def test_strict_false_resumes_anyway_and_says_what_differs(datasets: tuple[str, str]) -> None:
    url, other = datasets
    state, whole = _saved_state(url, other)
    warnings = ddp_even_messages(logging.WARNING)
    resumed = EvenLoader(_factory(url, "data", other))  # the same rows, in another directory
    resumed.load_state_dict(state, strict=False)
    assert [_ids(batch) for batch in resumed] == whole[STOP:]
    assert any("strict=False" in message and "data differs" in message for message in warnings)


@pytest.mark.timeout(120)
def test_a_state_of_a_plain_iterable_does_not_fit_a_petastorm_loop(
    datasets: tuple[str, str],
) -> None:
    listed = EvenLoader([[1], [2], [3], [4]])
    epoch = iter(listed)
    next(epoch), next(epoch)
    state = listed.state_dict()
    resumed = EvenLoader(_factory(datasets[0], "none", datasets[1]))
    resumed.load_state_dict(state)
    with pytest.raises(StateMismatchError) as refused:
        next(iter(resumed))
    assert refused.value.differ == () and set(refused.value.untold) == {"data"}


def test_a_reader_and_a_row_reader_differ_in_their_provenance(tmp_path: Path) -> None:
    from petastorm import make_batch_reader, make_reader

    from ddp_even.petastorm.reading import ReaderReading, row_groups_read_by
    from tests.helpers.datasets import write_unischema_dataset

    url = write_unischema_dataset(tmp_path / "u", [5, 5])

    def provenance(reader: Any) -> Any:
        with reader:
            row_groups = row_groups_read_by(reader)
            assert row_groups == frozenset({0, 1})
            return ReaderReading(reader, row_groups).provenance()

    rows = provenance(make_reader(url, reader_pool_type="dummy", schema_fields=["id"]))
    again = provenance(make_reader(url, reader_pool_type="dummy", schema_fields=["id"]))
    batches = provenance(make_batch_reader(url, reader_pool_type="dummy", schema_fields=["id"]))
    assert rows.compare(again) == ([], [])
    assert rows.compare(batches)[0] == ["reader"]
