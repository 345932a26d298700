"""What ddp_even assumes of petastorm's internals, checked against the pinned petastorm.

A failure here means petastorm changed under us: read the assertion's message, then the module
it names.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import petastorm
import pytest
from petastorm import make_reader
from petastorm.workers_pool.thread_pool import ThreadPool
from petastorm.workers_pool.ventilator import ConcurrentVentilator

from ddp_even import EvenLoader
from ddp_even.petastorm.thread_pool import close_end_of_results_race
from tests.helpers.datasets import shard_rows, write_unischema_dataset

PINNED = "0.12.1"
SIZES = [40, 5, 25, 3, 30, 7, 12, 1, 20, 9]
WORLD_SIZE = 4


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_unischema_dataset(tmp_path_factory.mktemp("contract") / "ds", SIZES)


@pytest.fixture
def unlucky_schedule(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The schedule under which petastorm 0.12.1's thread pool ends a pass too early.

    The ventilator thread starts late, and the main thread loses the CPU just before
    ``get_results`` asks the ventilator whether it has completed: by then the ventilator has
    ventilated every item and completed. Only delays are added; petastorm's code runs as is.
    """
    ventilate, completed = ConcurrentVentilator._ventilate, ConcurrentVentilator.completed

    def late_ventilate(self: Any) -> None:
        time.sleep(0.05)
        ventilate(self)

    def preempted_completed(self: Any) -> bool:
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.15)
        return bool(completed(self))

    monkeypatch.setattr(ConcurrentVentilator, "_ventilate", late_ventilate)
    monkeypatch.setattr(ConcurrentVentilator, "completed", preempted_completed)
    yield


def _rows(reader: Any) -> int:
    with reader:
        return sum(1 for _ in reader)


def _reader(url: str) -> Any:
    return make_reader(url, num_epochs=1, cur_shard=0, shard_count=WORLD_SIZE, workers_count=2)


@pytest.mark.timeout(60)
def test_petastorms_thread_pool_ends_a_pass_early_under_an_unlucky_schedule(
    url: str, unlucky_schedule: None
) -> None:
    assert petastorm.__version__ == PINNED, "ddp_even.petastorm.thread_pool fixes this release"
    assert _rows(_reader(url)) == 0, (
        "petastorm's ThreadPool.get_results no longer loses the shard under this schedule: "
        "see whether ddp_even.petastorm.thread_pool is still needed"
    )


@pytest.mark.timeout(60)
def test_the_race_free_pool_reads_the_whole_shard_under_the_same_schedule(
    url: str, unlucky_schedule: None
) -> None:
    reader = _reader(url)
    assert close_end_of_results_race(reader._workers_pool)
    assert _rows(reader) == shard_rows(SIZES, WORLD_SIZE, 0)


@pytest.mark.timeout(60)
def test_an_even_loader_reads_the_users_readers_through_the_race_free_pool(
    url: str, unlucky_schedule: None
) -> None:
    from petastorm.pytorch import DataLoader

    loader = EvenLoader(lambda: DataLoader(_reader(url), batch_size=8), "truncate")
    rows = sum(len(batch["id"]) for batch in loader)
    assert rows == shard_rows(SIZES, WORLD_SIZE, 0)


@pytest.mark.timeout(60)
def test_only_petastorms_own_thread_pool_is_changed(url: str) -> None:
    pool = ThreadPool(2)
    assert close_end_of_results_race(pool)
    assert close_end_of_results_race(pool), "a second call keeps the race-free version"
    assert not close_end_of_results_race(object())
    assert not close_end_of_results_race(None)


def test_the_source_of_the_fixed_method_is_the_one_read() -> None:
    # ddp_even.petastorm.thread_pool rewrites ThreadPool.get_results of 0.12.1; another
    # release may have other semantics to keep.
    import inspect

    source = inspect.getsource(ThreadPool.get_results)
    assert "self._ventilated_items == self._ventilated_items_processed" in source
    assert "self._ventilator.completed()" in source
    assert source.index("_ventilated_items_processed") < source.index("completed()"), (
        "petastorm now reads the ventilator first: the race may be fixed upstream"
    )
