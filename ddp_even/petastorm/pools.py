"""Petastorm's worker pools without their end-of-results race.

Each of petastorm 0.12.1's pools ends a pass when it sees nothing left to do, from two reads:
that every item ventilated *so far* is done (the thread and process pools compare counts; the
dummy pool finds its queue of items empty), and that its ventilator has completed. The
ventilator runs in a thread of its own: when it ventilates the pass's last items and completes
between the two reads, the pass ends with those items never read, and the reader stops early,
raising nothing. A shard the ventilator hands over at once (at most ``workers_count + 2`` row
groups) then comes back empty, and under CPU load a longer pass loses its last row groups
(``tests/test_petastorm_contract.py`` forces that schedule for each pool). An epoch with known
lengths then has one rank whose source ends while the others wait for it in DDP's all-reduce.

:func:`close_end_of_results_race` gives one pool a ``get_results`` that reads the ventilator
first: once it has completed, nothing more is ventilated, so equal counts (an empty queue) do
mean that the pass has ended. Everything else is petastorm's own code path. ddp_even applies it
to the pool of every petastorm reader it reads from, the user's included.
"""

from __future__ import annotations

import pickle
import queue
import time
import types
from collections.abc import Callable
from typing import Any

from petastorm.workers_pool import EmptyResultError, VentilatedItemProcessedMessage
from petastorm.workers_pool.dummy_pool import DummyPool
from petastorm.workers_pool.process_pool import ProcessPool
from petastorm.workers_pool.thread_pool import _VERIFY_END_OF_VENTILATION_PERIOD, ThreadPool

__all__ = ["close_end_of_results_race"]

# How long the dummy pool waits for its ventilator to hand over an item (petastorm's 0.1 s).
_DUMMY_POOL_WAIT_S = 0.1


def close_end_of_results_race(pool: Any) -> bool:
    """Give petastorm's thread, process or dummy pool ``pool`` a race-free ``get_results``;
    True if it was one of them.

    Any other pool (a subclass, or a pool whose ``get_results`` is not petastorm's own) is
    left as it is.
    """
    fixed = _FIXED.get(type(pool))
    if fixed is None:
        return False
    original, race_free = fixed
    current = getattr(pool.get_results, "__func__", None)
    if current is original:
        pool.get_results = types.MethodType(race_free, pool)
        return True
    return current is race_free


def _ventilated_all(pool: Any) -> bool:
    """Whether the pool's ventilator has completed (read first: see the module's docstring)."""
    ventilator = pool._ventilator
    return ventilator is None or bool(ventilator.completed())


def _processed(pool: Any) -> None:
    pool._ventilated_items_processed += 1
    if pool._ventilator is not None:
        pool._ventilator.processed_item()


def _thread_pool_results(pool: Any) -> Any:
    """``ThreadPool.get_results``, deciding that the pass has ended only once it has."""
    while True:
        if (
            _ventilated_all(pool)
            and pool._results_queue.empty()
            and pool._ventilated_items == pool._ventilated_items_processed
        ):
            raise EmptyResultError()
        try:
            result = pool._results_queue.get(timeout=_VERIFY_END_OF_VENTILATION_PERIOD)
        except queue.Empty:
            continue
        if isinstance(result, VentilatedItemProcessedMessage):
            _processed(pool)
            continue
        if isinstance(result, Exception):
            pool.stop()
            pool.join()
            raise result
        return result


def _process_pool_results(pool: Any) -> Any:
    """``ProcessPool.get_results``, likewise. A worker sends an item's results before the
    message that it is done, on one socket, so equal counts leave none of them unread."""
    while True:
        if _ventilated_all(pool) and pool._ventilated_items == pool._ventilated_items_processed:
            raise EmptyResultError()
        if not pool._results_receiver_poller.poll(_VERIFY_END_OF_VENTILATION_PERIOD * 1e3):
            continue
        fast, pickled = pool._results_receiver.recv_multipart(copy=pool._zmq_copy_buffers)
        message = pickle.loads(pickled)
        if isinstance(message, VentilatedItemProcessedMessage):
            _processed(pool)
        elif isinstance(message, Exception):
            pool.stop()
            pool.join()
            raise message
        elif not message:
            return pool._serializer.deserialize(fast if pool._zmq_copy_buffers else fast.buffer)


def _dummy_pool_results(pool: Any) -> Any:
    """``DummyPool.get_results`` (it works the items itself, on the caller's thread),
    likewise: an empty queue of items ends the pass only once the ventilator has completed."""
    if pool._results_queue:
        return pool._results_queue.pop(0)
    while True:
        ventilated_all = _ventilated_all(pool)
        if not pool._ventilator_queue:
            if ventilated_all:
                raise EmptyResultError()
            time.sleep(_DUMMY_POOL_WAIT_S)
            continue
        args, kwargs = pool._ventilator_queue.pop(0)
        pool._worker.process(*args, **kwargs)
        if pool._ventilator is not None:
            pool._ventilator.processed_item()
        if pool._results_queue:
            return pool._results_queue.pop(0)


_FIXED: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {
    ThreadPool: (ThreadPool.get_results, _thread_pool_results),
    ProcessPool: (ProcessPool.get_results, _process_pool_results),
    DummyPool: (DummyPool.get_results, _dummy_pool_results),
}
