"""What ddp_even assumes of petastorm's internals, checked against the pinned petastorm.

A failure here means petastorm changed under us: read the assertion's message, then the module
it names.
"""

from __future__ import annotations

import linecache
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import petastorm
import pytest
from petastorm import make_reader
from petastorm.workers_pool.dummy_pool import DummyPool
from petastorm.workers_pool.process_pool import ProcessPool
from petastorm.workers_pool.thread_pool import ThreadPool
from petastorm.workers_pool.ventilator import ConcurrentVentilator

from ddp_even import EvenLoader
from ddp_even.petastorm.pools import close_end_of_results_race
from tests.helpers.datasets import shard_rows, write_unischema_dataset

pytestmark = pytest.mark.petastorm

PINNED = "0.12.1"
SIZES = [40, 5, 25, 3, 30, 7, 12, 1, 20, 9]
WORLD_SIZE = 4


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_unischema_dataset(tmp_path_factory.mktemp("contract") / "ds", SIZES)


@pytest.fixture
def unlucky_schedule(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The schedule under which each of petastorm 0.12.1's pools ends a pass too early.

    The main thread, about to learn in a pool's ``get_results`` whether the ventilator has
    completed (the test that ends the pass), loses the CPU; the ventilator thread, which had
    waited for just that moment, ventilates every item and completes. Only waits are added;
    petastorm's code runs as is.
    """
    ventilate, completed = ConcurrentVentilator._ventilate, ConcurrentVentilator.completed
    asking = threading.Event()

    def late_ventilate(self: Any) -> None:
        asking.wait(timeout=5)  # until the main thread asks whether it has completed
        ventilate(self)

    def deciding_the_end() -> bool:
        """Whether completed() is asked by a pool's get_results (petastorm's, or ddp_even's
        through a helper), not by its debug log line."""
        frame = sys._getframe(2)
        for _ in range(2):
            if frame.f_code.co_name.endswith("results"):
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                return not line.startswith("str(")
            frame = frame.f_back
        return False

    def preempted_completed(self: Any) -> bool:
        if not asking.is_set() and deciding_the_end():
            asking.set()
            deadline = time.monotonic() + 5
            while not completed(self) and time.monotonic() < deadline:
                time.sleep(0.01)
        return bool(completed(self))

    monkeypatch.setattr(ConcurrentVentilator, "_ventilate", late_ventilate)
    monkeypatch.setattr(ConcurrentVentilator, "completed", preempted_completed)
    yield


def _rows(reader: Any) -> int:
    with reader:
        return sum(1 for _ in reader)


POOLS = ["thread", "process", "dummy"]


def _reader(url: str, pool: str = "thread") -> Any:
    return make_reader(
        url,
        num_epochs=1,
        cur_shard=0,
        shard_count=WORLD_SIZE,
        reader_pool_type=pool,
        workers_count=1 if pool == "process" else 2,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", POOLS)
def test_petastorms_pools_end_a_pass_early_under_an_unlucky_schedule(
    url: str, unlucky_schedule: None, pool: str
) -> None:
    assert petastorm.__version__ == PINNED, "ddp_even.petastorm.pools fixes this release"
    assert _rows(_reader(url, pool)) < shard_rows(SIZES, WORLD_SIZE, 0), (
        f"petastorm's {pool} pool no longer loses rows under this schedule: see whether "
        "ddp_even.petastorm.pools is still needed"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", POOLS)
def test_the_race_free_pools_read_the_whole_shard_under_the_same_schedule(
    url: str, unlucky_schedule: None, pool: str
) -> None:
    reader = _reader(url, pool)
    assert close_end_of_results_race(reader._workers_pool)
    assert _rows(reader) == shard_rows(SIZES, WORLD_SIZE, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", POOLS)
def test_an_even_loader_reads_the_users_readers_through_the_race_free_pool(
    url: str, unlucky_schedule: None, pool: str
) -> None:
    from petastorm.pytorch import DataLoader

    loader = EvenLoader(lambda: DataLoader(_reader(url, pool), batch_size=8), "truncate")
    rows = sum(len(batch["id"]) for batch in loader)
    assert rows == shard_rows(SIZES, WORLD_SIZE, 0)


@pytest.mark.timeout(60)
def test_only_petastorms_own_pools_are_changed(url: str) -> None:
    for pool in (ThreadPool(2), DummyPool()):
        assert close_end_of_results_race(pool)
        assert close_end_of_results_race(pool), "a second call keeps the race-free version"
    assert not close_end_of_results_race(object())
    assert not close_end_of_results_race(None)


def test_the_sources_of_the_fixed_methods_are_the_ones_read() -> None:
    # ddp_even.petastorm.pools rewrites the pools' get_results of 0.12.1; another release may
    # have other semantics to keep.
    import inspect

    for pool in (ThreadPool, ProcessPool):
        source = inspect.getsource(pool.get_results)
        assert "self._ventilated_items == self._ventilated_items_processed" in source
        assert "self._ventilator.completed()" in source
        assert source.index("_ventilated_items_processed") < source.index("completed()"), (
            f"petastorm's {pool.__name__} now reads the ventilator first: fixed upstream?"
        )
    source = inspect.getsource(DummyPool.get_results)
    assert source.index("self._ventilator_queue or") < source.index("completed()"), (
        "petastorm's DummyPool now reads the ventilator first: fixed upstream?"
    )


# --- every private attribute listed in ddp_even/petastorm/__init__.py ---------------------


def _contract(holds: bool, attribute: str) -> None:
    assert holds, (
        f"petastorm {petastorm.__version__} (ddp_even is written for {PINNED}) changed "
        f"{attribute}: see ddp_even/petastorm/__init__.py for what relies on it"
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
def test_what_a_readers_provenance_reads_is_where_ddp_even_looks(url: str) -> None:
    from petastorm import TransformSpec

    from ddp_even.petastorm import reading

    spec = TransformSpec(lambda frame: frame)
    with make_reader(
        url,
        cur_shard=1,
        shard_count=WORLD_SIZE,
        workers_count=1,
        seed=7,
        shuffle_rows=True,
        transform_spec=spec,
        shuffle_row_groups=False,
    ) as reader:
        args = reader._workers_pool._workers[0]._worker_impl.args
        _contract(len(args[reading._ROW_GROUPS]) == len(SIZES), "the workers' args[4] (row groups)")
        _contract(args[reading._TRANSFORM_SPEC] is spec, "the workers' args[6] (transform_spec)")
        _contract(args[reading._FILTERS] is None, "the workers' args[8] (filters)")
        _contract(args[reading._SHUFFLE_ROWS] is True, "the workers' args[9] (shuffle_rows)")
        _contract(args[reading._SEED] == 7, "the workers' args[10] (seed)")
        _contract(reader.ventilator._randomize_item_order is False, "the ventilator's order")
        item = reader.ventilator._items_to_ventilate[0]
        _contract(item["shuffle_row_drop_partition"] == (0, 1), "the items' row-drop parts")
        _contract(reader.is_batched_reader is False, "Reader.is_batched_reader")
        dataset = reader.dataset
        _contract(not dataset._partitions, "Reader.dataset._partitions")
        _contract(dataset._common_metadata is not None, "Reader.dataset._common_metadata")
        for name in ("_results_receiver_poller", "_results_receiver", "_serializer"):
            _contract(name in ProcessPool(1).__dict__, f"ProcessPool.{name}")
        _contract("_zmq_copy_buffers" in ProcessPool(1).__dict__, "ProcessPool._zmq_copy_buffers")
        _contract("_ventilator_queue" in DummyPool().__dict__, "DummyPool._ventilator_queue")


@pytest.mark.timeout(60)
def test_a_dummy_pool_keeps_its_worker_and_a_list_of_results(url: str) -> None:
    # The race-free DummyPool.get_results (pools.py) runs the worker and pops the list itself.
    with make_reader(url, reader_pool_type="dummy", schema_fields=["id"]) as reader:
        pool = reader._workers_pool
        _contract(isinstance(pool._results_queue, list), "DummyPool._results_queue")
        item = reader.ventilator._items_to_ventilate[0]
        pool._worker.process(item["piece_index"], item["worker_predicate"], (0, 1))
        published = sum(len(rows) for rows in pool._results_queue)
        _contract(published == SIZES[item["piece_index"]], "DummyPool._worker.process")
        pool._results_queue.clear()


def test_the_ventilator_and_the_loader_have_what_ddp_even_calls_and_empties() -> None:
    import inspect

    from petastorm.pytorch import DataLoader

    # The race-free get_results (pools.py) counts each result it hands out as processed.
    _contract(callable(ConcurrentVentilator.processed_item), "ConcurrentVentilator.processed_item")
    _contract("_batch_acc" in inspect.getsource(DataLoader.__init__), "LoaderBase._batch_acc")
