"""A state that does not fit the loader is refused naming each field that differs, and only
those, in words: never a digest.

A resume with another ``batch_size`` was refused with ``ValueError: ... other settings (...
plan=31279cb5) than this one (... plan=084d6ec6)``: hashes, not the field. A state of another
reader listed fields that do not differ, and said "the rows it had read ... were other rows",
untrue there. Now every refusal is a :class:`~ddp_even.StateMismatchError` whose ``differ``
names exactly the fields that differ (settings with their values there and here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ddp_even import EvenLoader, StateMismatchError
from ddp_even.runtime.settings import differing_settings
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import run_ranks

SIZES = [[10, 7], [12, 9], [8]]
# Reading in plan order, so that a state can be resumed at all.
IN_ORDER = {"shuffle_row_groups": False}
# A digest as the old message showed them (plan=31279cb5): 8 or more hex digits.
DIGEST = re.compile(r"\b[0-9a-f]{8,}\b")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plain_dataset(tmp_path_factory.mktemp("refusals") / "data", SIZES)


def _saved(url: str, **options: Any) -> dict[str, Any]:
    loader = EvenLoader.from_parquet(url, 4, reader_kwargs=IN_ORDER, **options)
    epoch = iter(loader)
    next(epoch)
    next(epoch)
    return loader.state_dict()


def _refusal(url: str, state: dict[str, Any], **options: Any) -> StateMismatchError:
    options = {"batch_size": 4, **options}
    loader = EvenLoader.from_parquet(url, reader_kwargs=IN_ORDER, **options)
    with pytest.raises(StateMismatchError) as refused:
        loader.load_state_dict(state)
    assert not DIGEST.search(str(refused.value)), str(refused.value)
    return refused.value


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "differ", "words"),
    [
        ({"batch_size": 8}, ("batch_size",), "(batch_size=4) than this one (batch_size=8)"),
        ({"mode": "pad"}, ("mode",), "(mode=truncate) than this one (mode=pad)"),
        ({"steps_per_epoch": 3}, ("steps_per_epoch",), "steps_per_epoch=3"),
        (
            {"mode": "pad", "batch_size": 5},
            ("mode", "batch_size"),
            "(mode=truncate, batch_size=4) than this one (mode=pad, batch_size=5)",
        ),
    ],
)
def test_other_settings_are_named_with_their_values(
    url: str, change: dict[str, Any], differ: tuple[str, ...], words: str
) -> None:
    refused = _refusal(url, _saved(url), **change)
    assert refused.differ == differ
    assert words in str(refused)
    assert "strict=False" not in str(refused), "other steps cannot be resumed anyway"


@pytest.mark.timeout(120)
def test_a_reader_setting_is_named_alone_and_may_be_forced(url: str) -> None:
    state = _saved(url)
    loader = EvenLoader.from_parquet(
        url, 4, reader_kwargs={**IN_ORDER, "schema_fields": ["id", "value"]}
    )
    with pytest.raises(StateMismatchError) as refused:
        loader.load_state_dict(state)
    assert refused.value.differ == ("schema_fields",)
    assert "were other rows" not in str(refused.value)
    assert "strict=False" in str(refused.value)


def test_differing_settings_compares_field_by_field() -> None:
    saved = "mode=pad steps_per_epoch=None sync_every=epoch sharding=rows batch_size=8"
    assert differing_settings(saved, saved) == {}
    assert differing_settings(saved, saved.replace("sharding=rows ", "")) == {
        "sharding": ("rows", None)
    }


def _two_ranks(rank: int, world_size: int, url: str) -> dict[str, Any]:
    state = _saved(url)
    loader = EvenLoader.from_parquet(url, 8, reader_kwargs=IN_ORDER)
    try:
        loader.load_state_dict(state)
    except StateMismatchError as error:
        return {"differ": error.differ, "message": str(error)}
    return {"differ": None, "message": ""}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_every_rank_refuses_another_batch_size_the_same_way(url: str) -> None:
    ranks = run_ranks(_two_ranks, 2, url, timeout=90)
    assert [rank["differ"] for rank in ranks] == [("batch_size",), ("batch_size",)]
    assert ranks[0]["message"] == ranks[1]["message"]
    assert "(batch_size=4) than this one (batch_size=8)" in ranks[0]["message"]
    assert not DIGEST.search(ranks[0]["message"])


def _wrapped_state(url: str) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    def one_pass() -> Any:
        reader = make_batch_reader(
            url, num_epochs=1, shuffle_row_groups=False, reader_pool_type="dummy"
        )
        return BatchedDataLoader(reader, batch_size=4)

    loader = EvenLoader(one_pass)
    epoch = iter(loader)
    next(epoch)
    next(epoch)
    state = loader.state_dict()
    del epoch
    return state


@pytest.mark.petastorm
@pytest.mark.timeout(120)
def test_a_state_of_another_reader_names_the_reader_and_no_field_that_agrees(
    url: str, tmp_path: Path
) -> None:
    """A petastorm loop's state loaded into the pyarrow reader: both read the same rows of the
    same files at the same batch size; they differ in their reader (and this one has a plan)."""
    refused = _refusal(url, _wrapped_state(url))
    assert refused.differ == ("plan", "reader")
    assert "(plan=(none)) than this one (plan=(sharding=round_robin batch_size=4))" in str(refused)
    # Parts petastorm's reader has and the pyarrow reader has not (or means otherwise).
    for agrees in ("data", "seed", "schema_fields", "num_epochs", "shuffle_row_groups"):
        assert agrees not in refused.differ, (agrees, str(refused))
    assert "were other rows" not in str(refused)
    assert "may not be the rows" in str(refused)
