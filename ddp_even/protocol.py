"""The agreement: what each rank says before a window of steps, and what all of them hear back.

Every rank sends one small int64 vector; a single ``all_reduce(MAX)`` combines them. Each
quantity whose minimum also matters is sent twice, as ``x`` and ``-x``, so the one MAX
reduction returns both ``max(x)`` and ``-min(x)``. Flags are sent as ``rank + 1`` (0 when
unset), so the reduction also names one rank that raised them; the rare error paths then
gather the full per-rank details with one more collective that every rank enters, because
every rank saw the same flag.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_even.errors import PeerTimeoutError

logger = logging.getLogger("ddp_even")

_NO_RANK = 0


@dataclass(frozen=True)
class Report:
    """What one rank tells the others before a window of steps."""

    rank: int
    epoch: int
    # Hash of the settings every rank must share (mode, steps_per_epoch, window).
    fingerprint: int
    # Those settings in words, for the error message when they differ.
    settings: str
    # Batches this rank can hand out in the window (buffered, or known from a length).
    available: int
    # Of those, batches from its first pass over its shard (not repeats).
    own_available: int
    # Its first pass ended without a single batch.
    empty_shard: bool = False
    # Its source raised; the exception is kept locally and described in ``failure``.
    failed: bool = False
    failure: tuple[str, str] | None = None


@dataclass(frozen=True)
class Agreement:
    """What every rank learns from the reduction: the same values on every rank."""

    min_available: int
    max_available: int
    max_own_available: int
    epochs_differ: bool
    settings_differ: bool
    # One rank whose source failed / whose shard is empty (the highest), or None.
    failed_rank: int | None
    empty_rank: int | None

    @property
    def has_problem(self) -> bool:
        return (
            self.epochs_differ
            or self.settings_differ
            or self.failed_rank is not None
            or self.empty_rank is not None
        )


def _encode(report: Report) -> torch.Tensor:
    flag = report.rank + 1
    return torch.tensor(
        [
            report.available,
            -report.available,
            report.own_available,
            report.epoch,
            -report.epoch,
            report.fingerprint,
            -report.fingerprint,
            flag if report.failed else _NO_RANK,
            flag if report.empty_shard else _NO_RANK,
        ],
        dtype=torch.int64,
    )


def _decode(reduced: torch.Tensor) -> Agreement:
    values = reduced.tolist()
    return Agreement(
        max_available=values[0],
        min_available=-values[1],
        max_own_available=values[2],
        epochs_differ=values[3] != -values[4],
        settings_differ=values[5] != -values[6],
        failed_rank=values[7] - 1 if values[7] != _NO_RANK else None,
        empty_rank=values[8] - 1 if values[8] != _NO_RANK else None,
    )


class PendingAgreement(Protocol):
    """An agreement that was started; ``wait`` returns its result."""

    def wait(self) -> Agreement: ...


class Agreer(Protocol):
    """Runs agreements among the ranks of one training group."""

    rank: int
    world_size: int

    def start(self, report: Report) -> PendingAgreement:
        """Send ``report`` without blocking; every rank must start the same agreements."""
        ...

    def gather_reports(self, report: Report) -> list[Report]:
        """Every rank's full report, in rank order (used on the rare error paths)."""
        ...

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        """Every rank's ``counts`` vector (same length everywhere), in rank order."""
        ...


@dataclass(frozen=True)
class _Done:
    agreement: Agreement

    def wait(self) -> Agreement:
        return self.agreement


class SoloAgreer:
    """The agreement of a single process: no collective, the same decisions."""

    rank = 0
    world_size = 1

    def start(self, report: Report) -> PendingAgreement:
        return _Done(_decode(_encode(report)))

    def gather_reports(self, report: Report) -> list[Report]:
        return [report]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        return [list(counts)]


class _InFlight:
    def __init__(self, agreer: CollectiveAgreer, work: Any, buffer: torch.Tensor) -> None:
        self._agreer = agreer
        self._work = work
        self._buffer = buffer
        self._result: Agreement | None = None

    def wait(self) -> Agreement:
        if self._result is None:
            try:
                self._work.wait()
            except RuntimeError as error:
                raise self._agreer.timeout_error(error) from error
            self._result = _decode(self._buffer)
        return self._result


class CollectiveAgreer:
    """Agreements over a dedicated CPU gloo group spanning the training group's ranks.

    The group is our own so that control messages never queue behind gradient buckets, never
    touch a GPU stream, and time out after ``timeout`` seconds instead of the training group's
    30 minutes.
    """

    def __init__(self, control_group: dist.ProcessGroup, timeout: float) -> None:
        self.group = control_group
        self.rank = dist.get_rank(control_group)
        self.world_size = dist.get_world_size(control_group)
        self.timeout = timeout

    def start(self, report: Report) -> PendingAgreement:
        buffer = _encode(report)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _InFlight(self, work, buffer)

    def gather_reports(self, report: Report) -> list[Report]:
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, dataclasses.asdict(report), group=self.group)
        except RuntimeError as error:
            raise self.timeout_error(error) from error
        return [Report(**fields) for fields in gathered]

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        local = torch.tensor(counts, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, local, group=self.group)
        except RuntimeError as error:
            raise self.timeout_error(error) from error
        return [tensor.tolist() for tensor in gathered]

    def timeout_error(self, error: RuntimeError) -> PeerTimeoutError:
        return PeerTimeoutError(
            _ranks_named_in(str(error), self.world_size), self.timeout, str(error)
        )


def _ranks_named_in(message: str, world_size: int) -> tuple[int, ...]:
    """Ranks gloo names in a timeout or connection error ("... rank 3 ..."), if any."""
    named = {int(match) for match in re.findall(r"[Rr]ank[ :=]*(\d+)", message)}
    return tuple(sorted(rank for rank in named if rank < world_size))


_control_groups: dict[tuple[Any, float], dist.ProcessGroup] = {}


def control_group_for(
    training_group: dist.ProcessGroup | None, timeout: float
) -> dist.ProcessGroup:
    """The gloo group ddp_even talks on for ``training_group``, created once and cached.

    Creating it is a collective over the training group's ranks, so every rank must reach this
    call; ``EvenLoader`` does so at the start of its first epoch, a point every rank reaches.
    """
    group = training_group if training_group is not None else dist.group.WORLD
    key = (group, timeout)
    if key not in _control_groups:
        ranks = dist.get_process_group_ranks(group)
        _control_groups[key] = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=True,
        )
        logger.debug("created a gloo control group over ranks %s", ranks)
    return _control_groups[key]
