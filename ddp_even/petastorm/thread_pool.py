"""Petastorm's thread pool without its end-of-results race.

Petastorm 0.12.1's ``ThreadPool.get_results`` ends a pass when three things hold, read in
this order: its results queue is empty, every item ventilated *so far* has been processed,
and its ventilator has completed. The ventilator runs in a thread of its own: when it
ventilates the pass's last items and completes between the second read and the third, the
pass ends with those items still in flight and the reader stops early, raising nothing. A
shard of at most ``workers_count + 2`` row groups is ventilated all at once, so it comes back
empty when the ventilator starts late and the main thread loses the CPU at the wrong moment
(rare, and likelier under CPU load; ``tests/test_petastorm_contract.py`` forces that
schedule). An epoch with known lengths then has one rank whose source ends while the others
wait for it in DDP's all-reduce.

:func:`close_end_of_results_race` gives one pool a ``get_results`` that reads the ventilator
first: once it has completed, the count of items ventilated is final, so an empty queue and
equal counts do mean that nothing is in flight. Everything else is petastorm's own code path.
ddp_even applies it to the pool of every petastorm reader it reads from, the user's included.
"""

from __future__ import annotations

import logging
import queue
import types
from typing import Any

from petastorm.workers_pool import EmptyResultError, VentilatedItemProcessedMessage
from petastorm.workers_pool.thread_pool import _VERIFY_END_OF_VENTILATION_PERIOD, ThreadPool

__all__ = ["close_end_of_results_race"]

logger = logging.getLogger("ddp_even")


def close_end_of_results_race(pool: Any) -> bool:
    """Give petastorm ``ThreadPool`` ``pool`` a race-free ``get_results``; True if it was one.

    Any other pool (process, dummy, or a thread pool whose ``get_results`` is not petastorm's
    own) is left as it is.
    """
    if type(pool) is not ThreadPool:
        return False
    if getattr(pool.get_results, "__func__", None) is not ThreadPool.get_results:
        return getattr(pool.get_results, "__func__", None) is _get_results
    pool.get_results = types.MethodType(_get_results, pool)
    return True


def _get_results(pool: Any) -> Any:
    """``ThreadPool.get_results``, deciding that the pass has ended only once it has."""
    ventilator = pool._ventilator
    while True:
        # The ventilator first: after it completes, no item is added to the counts.
        ventilated_all = ventilator is None or ventilator.completed()
        if (
            ventilated_all
            and pool._results_queue.empty()
            and pool._ventilated_items == pool._ventilated_items_processed
        ):
            raise EmptyResultError()
        try:
            result = pool._results_queue.get(timeout=_VERIFY_END_OF_VENTILATION_PERIOD)
        except queue.Empty:
            continue
        if isinstance(result, VentilatedItemProcessedMessage):
            pool._ventilated_items_processed += 1
            if ventilator is not None:
                ventilator.processed_item()
            continue
        if isinstance(result, Exception):
            pool.stop()
            pool.join()
            raise result
        return result
