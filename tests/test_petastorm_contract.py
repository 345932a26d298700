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
from ddp_even.petastorm.pools import close_end_of_results_race
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


# --- every private attribute listed in ddp_even/petastorm/__init__.py ---------------------


def _contract(holds: bool, attribute: str) -> None:
    assert holds, (
        f"petastorm {petastorm.__version__} (ddp_even is written for {PINNED}) changed "
        f"{attribute}: see ddp_even/petastorm/__init__.py for what relies on it"
    )


def test_the_reader_steps_the_planned_reader_overrides_take_the_same_parameters() -> None:
    import inspect

    from petastorm.reader import Reader

    partition = list(inspect.signature(Reader._partition_row_groups).parameters)
    _contract(
        partition
        == [
            "self",
            "dataset",
            "row_groups",
            "shard_count",
            "cur_shard",
            "filtered_row_group_indexes",
            "seed",
        ],
        "Reader._partition_row_groups",
    )
    ventilator = list(inspect.signature(Reader._create_ventilator).parameters)
    _contract(
        ventilator
        == [
            "self",
            "row_group_indexes",
            "shuffle_row_groups",
            "shuffle_row_drop_partitions",
            "num_epochs",
            "worker_predicate",
            "max_ventilation_queue_size",
            "seed",
        ],
        "Reader._create_ventilator",
    )


@pytest.mark.timeout(60)
def test_a_thread_pool_readers_internals_are_where_ddp_even_looks(url: str) -> None:
    from petastorm.workers_pool import thread_pool

    with make_reader(url, cur_shard=1, shard_count=WORLD_SIZE, workers_count=2, seed=7) as reader:
        pool = reader._workers_pool
        _contract(isinstance(pool, ThreadPool), "Reader._workers_pool")
        items = list(reader.ventilator._items_to_ventilate)
        _contract(
            sorted(item["piece_index"] for item in items) == list(range(1, len(SIZES), 4))
            and all("worker_predicate" in item for item in items),
            "Reader.ventilator._items_to_ventilate",
        )
        worker = pool._workers[0]._worker_impl
        _contract(hasattr(worker, "_transform_spec"), "the worker's _transform_spec")
        _contract(worker.args[10] == 7, "the workers' args[10] (the seed)")
        for name in ("publish_func", "_shuffle_rows", "_split_pieces"):
            _contract(hasattr(worker, name), f"the worker's {name}")
        for name in ("_ventilator", "_results_queue", "_ventilated_items"):
            _contract(hasattr(pool, name), f"ThreadPool.{name}")
        _contract(hasattr(pool, "_ventilated_items_processed"), "ThreadPool counts")
        _contract(
            isinstance(thread_pool._VERIFY_END_OF_VENTILATION_PERIOD, float),
            "thread_pool._VERIFY_END_OF_VENTILATION_PERIOD",
        )
        _contract(bool(reader.dataset.paths), "Reader.dataset.paths")
        _contract(reader.dataset._fs is not None, "Reader.dataset._fs")


@pytest.mark.timeout(60)
def test_a_dummy_pool_keeps_its_worker_and_a_list_of_results(url: str) -> None:
    with make_reader(url, reader_pool_type="dummy", schema_fields=["id"]) as reader:
        pool = reader._workers_pool
        _contract(isinstance(pool._results_queue, list), "DummyPool._results_queue")
        item = reader.ventilator._items_to_ventilate[0]
        pool._worker.process(item["piece_index"], item["worker_predicate"], (0, 1))
        published = sum(len(rows) for rows in pool._results_queue)
        _contract(published == SIZES[item["piece_index"]], "DummyPool._worker.process")
        pool._results_queue.clear()


def test_the_ventilator_and_the_loader_have_what_ddp_even_subclasses_and_empties() -> None:
    import inspect

    from petastorm.arrow_reader_worker import ArrowReaderWorker
    from petastorm.pytorch import DataLoader

    parameters = inspect.signature(ConcurrentVentilator.__init__).parameters
    _contract(
        {"ventilate_fn", "items_to_ventilate", "iterations", "randomize_item_order"}
        <= set(parameters),
        "ConcurrentVentilator.__init__",
    )
    _contract(callable(ConcurrentVentilator.processed_item), "ConcurrentVentilator.processed_item")
    _contract(
        hasattr(ArrowReaderWorker, "_read_with_shuffle_row_drop"),
        "ArrowReaderWorker._read_with_shuffle_row_drop",
    )
    _contract("_batch_acc" in inspect.getsource(DataLoader.__init__), "LoaderBase._batch_acc")
