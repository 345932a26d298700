"""A planned reader's results in ventilation order, from a thread pool of several workers.

Imported only when a planned reader is built (it imports petastorm 0.12.1). Petastorm's
``ThreadPool.get_results`` hands results out in the order the workers finish them, so with
several workers the order of a pass changes from run to run. A planned reader that needs its
order (:mod:`ddp_even.planning.pass_order`) numbers its work items (``position``); its workers
(:mod:`ddp_even.petastorm.planned_workers`) publish exactly one ``(position, rows)`` per item,
``rows`` None when the item keeps nothing; :class:`ResultsInOrder` stands in for the pool on
the reader, buffers what arrives early and hands the rows out by position.

The buffer is bounded by the ventilator (:class:`ShardVentilator` with
``counts_handed_out=True``): it counts an item done when its result is handed out, not when a
worker finishes it, and petastorm's reader lets at most ``workers_count + 2`` items be
ventilated and not done. So at most that many results wait, in the pool's queue or here, while
the item at the head of the order is read.
"""

from __future__ import annotations

from typing import Any

from petastorm.workers_pool import EmptyResultError
from petastorm.workers_pool.ventilator import ConcurrentVentilator

__all__ = ["ResultsInOrder", "ShardVentilator"]


class ShardVentilator(ConcurrentVentilator):  # type: ignore[misc]  # petastorm has no type hints
    """Petastorm's ventilator; with ``counts_handed_out`` an item is done once handed out.

    Petastorm's pools call :meth:`processed_item` when a worker finishes an item; with
    ``counts_handed_out`` that call is ignored and :meth:`handed_out` counts instead, so that
    the ventilation limit also bounds the results waiting for their turn.
    """

    def __init__(self, *args: Any, counts_handed_out: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counts_handed_out = counts_handed_out

    def processed_item(self) -> None:
        if not self._counts_handed_out:
            super().processed_item()

    def handed_out(self) -> None:
        """One more item's result left :class:`ResultsInOrder` (rows or nothing)."""
        super().processed_item()


class ResultsInOrder:
    """Stands in for a reader's worker pool: its results in ``position`` order.

    Everything but :meth:`get_results` is the pool's (``stop``, ``join``, ``diagnostics``...).
    A worker's exception and the end of the results (``EmptyResultError``) come from the
    pool's ``get_results`` as petastorm raises them.
    """

    def __init__(self, ventilator: ShardVentilator) -> None:
        self.pool: Any = None  # set once petastorm's Reader has started it
        self._ventilator = ventilator
        self._waiting: dict[int, Any] = {}
        self._next = 0

    def get_results(self) -> Any:
        while True:
            if self._next in self._waiting:
                rows = self._waiting.pop(self._next)
                self._next += 1
                self._ventilator.handed_out()
                if rows is not None:
                    return rows
                continue
            try:
                position, rows = self.pool.get_results()
            except EmptyResultError:
                if self._waiting:
                    raise RuntimeError(
                        f"the reader's workers gave no result for work item {self._next} "
                        f"but did for {sorted(self._waiting)[:8]}: please report this"
                    ) from None
                raise
            self._waiting[position] = rows

    def restart(self) -> None:
        """Start again at position 0 (``Reader.reset`` ventilates the items again)."""
        self._waiting.clear()
        self._next = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)
