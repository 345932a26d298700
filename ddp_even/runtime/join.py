"""The join shape of an epoch: each rank hands out all its batches inside torch's ``Join``.

The loader is the *first* joinable in ``Join([loader, *joinables])``: ranks that have not run
out notify ``Join`` at every step and hold the window's agreement at its boundaries; ranks that
have run out shadow both the others' DDP all-reduces (through the user's joinables) and those
agreements (through the loader's join hook), at the same global steps. So a failing source or a
mismatch reaches the joined ranks too.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp_even.errors import EvenLoaderError

if TYPE_CHECKING:
    from ddp_even.runtime.epochs import EpochRun

BatchT = TypeVar("BatchT")

__all__ = ["run_join"]


def refuse_join_inside_lightning() -> None:
    """Join mode cannot work inside Lightning's fit loop: fail at once, on every rank.

    Lightning makes a collective of its own at every step, which torch's ``Join`` cannot
    shadow; every rank runs this check at the same point, so every rank raises. Relies on one
    CPython private, ``sys._getframe``, to see whether Lightning's fit loop called (the frames
    of every Python, tested by ``tests/test_lightning.py``).
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("lightning.pytorch.", "pytorch_lightning.")):
            raise EvenLoaderError(
                "join mode cannot run inside a Lightning Trainer: Lightning makes a collective "
                "of its own at every step (it broadcasts a stop signal), which torch's Join "
                "cannot shadow for the ranks that ran out, so the job would hang. Use "
                "mode='pad' (every row once, as join) or mode='truncate' or mode='cycle' under "
                "Lightning"
            )
        frame = frame.f_back


class _LoaderJoinable(Joinable, JoinHook):
    """The loader's place in ``Join``, and its join hook: first, so its per-window agreement
    is shadowed too."""

    def __init__(
        self, device: torch.device, process_group: Any, shadow_step: Callable[[], None]
    ) -> None:
        super().__init__()
        self._device = device
        self._process_group = process_group
        self._shadow_step = shadow_step

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self

    def main_hook(self) -> None:
        self._shadow_step()

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self._process_group


class _KeepWarningFilters:
    """Enters a ``Join``, undoing what its exit does to the process's warning filters.

    ``Join.__exit__`` calls ``warnings.simplefilter("once")`` for the whole process, which would
    bring back every warning the training script had silenced.
    """

    def __init__(self, join: Join) -> None:
        self._join = join

    def __enter__(self) -> None:
        self._join.__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc_info: Any) -> Any:
        with warnings.catch_warnings():
            return self._join.__exit__(*exc_info)


def run_join(run: EpochRun[BatchT], joinables: Sequence[Joinable]) -> Generator[BatchT, None, None]:
    try:
        refuse_join_inside_lightning()
        window = run.settings.sync_every
        assert window is not None

        def shadow_step() -> None:
            # This rank has joined; it still takes part in the agreements of the ranks that
            # have not, at the same steps they hold them.
            if run.steps_done % window == 0:
                run.agree(run.report(0, 0, run.feed.empty_shard, most=window))
            run.steps_done += 1

        loader_joinable = _LoaderJoinable(
            joinables[0].join_device, joinables[0].join_process_group, shadow_step
        )
        with _KeepWarningFilters(Join([loader_joinable, *joinables])):
            try:
                while True:
                    # Windows start at multiples of `window` (where joined ranks shadow them), also
                    # in an epoch resumed part-way.
                    size = window - run.steps_done % window
                    run.feed.fill(size)
                    if run.feed.buffered == 0 and run.feed.failure is None:
                        break
                    Join.notify_join_context(loader_joinable)
                    run.agree(
                        run.report(
                            run.feed.buffered,
                            run.feed.own_buffered,
                            run.feed.empty_shard,
                            most=window,
                        )
                    )
                    agreed = run.feed.buffered
                    for index in range(agreed):
                        if index > 0:
                            Join.notify_join_context(loader_joinable)
                        run.steps_done += 1
                        yield run.hand_out(run.feed.take())
                    if agreed < size:
                        break
            except GeneratorExit:
                # The consumer stopped (a `break` on every rank at the same step): leave through
                # Join's normal exit below, which releases the ranks that joined earlier; they
                # then gather the statistics, so this rank does too.
                if sys.is_finalizing():
                    raise
        run.finish(run.feed.had_more_own_data())
    finally:
        run.close()
