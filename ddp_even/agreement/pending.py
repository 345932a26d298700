"""Control collectives in flight: what the agreers' ``start`` methods return until waited for.

An agreement starts as the short form's all-reduce (``wire.py``). When any rank needs the long
form, every rank sends it too: a rank that needs it starts it at once, beside the short form;
the others learn of it from the short form's result and start it when they wait, which every
rank does for every agreement it starts, in the same order. So the ranks make the same
collectives in the same order whichever forms they sent. A loop left early (a ``finally``)
only finishes what it started: when the ranks stop at the same step nothing more is needed,
and otherwise the rank that needs more is the one whose roll call names those elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from ddp_even.agreement.wire import Agreement
from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.rollcall import Ticket

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Pending(Protocol[T_co]):
    """A control collective that was started; ``wait`` returns its result."""

    def wait(self) -> T_co: ...

    def finish_started(self) -> None:
        """Wait for what was started, starting nothing more: for a loop left early, where a
        rank that needs more is elsewhere, and waiting for it is the error its roll call names.
        """
        ...


PendingAgreement = Pending[Agreement]


@dataclass(frozen=True)
class Done(Generic[T]):
    """A result known without a collective (a single rank)."""

    result: T

    def wait(self) -> T:
        return self.result

    def finish_started(self) -> None:
        pass


class _AwaitsWork(Protocol):
    def await_work(self, work: Any, ticket: Ticket) -> None: ...


class InFlight(Generic[T]):
    """One started collective: waited for under the agreer's deadlines, read once."""

    def __init__(
        self,
        agreer: _AwaitsWork,
        work: Any,
        buffer: torch.Tensor,
        ticket: Ticket,
        read: Callable[[list[int]], T],
    ) -> None:
        self._agreer = agreer
        self._work = work
        self._buffer = buffer
        self._ticket = ticket
        self._read = read
        self._waited = False
        self._result: T
        self._failure: EvenLoaderError | None = None

    def wait(self) -> T:
        if self._failure is not None:
            # Waited once already (e.g. again in a ``finally``): the same error, at once.
            raise self._failure
        if not self._waited:
            try:
                self._agreer.await_work(self._work, self._ticket)
            except EvenLoaderError as error:
                self._failure = error
                raise
            self._result = self._read(self._buffer.tolist())
            self._waited = True
        return self._result

    def finish_started(self) -> None:
        self.wait()


class TwoForms:
    """An agreement in flight: its short form, and its long form once any rank needs it."""

    def __init__(
        self,
        short: Pending[Agreement | None],
        long: Pending[Agreement] | None,
        start_long: Callable[[], Pending[Agreement]],
    ) -> None:
        self._short = short
        self._long = long
        self._start_long = start_long

    def wait(self) -> Agreement:
        agreement = self._short.wait()
        if agreement is not None:
            return agreement
        if self._long is None:
            # Another rank sent the long form: this rank joins it.
            self._long = self._start_long()
        return self._long.wait()

    def finish_started(self) -> None:
        self._short.wait()
        if self._long is not None:
            self._long.wait()
