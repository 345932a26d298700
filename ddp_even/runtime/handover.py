"""Batches handed from one rank to another (mode share), point to point over gloo.

A batch travels as a few messages on one pair of ranks: its header (with the header's size
first, in a message of fixed size; a header too long for it sends the rest in a second one),
then each of its tensors as itself (``isend``/``irecv`` of the tensor's own memory, never
pickled bytes). The header is the batch pickled with every CPU tensor and every numpy array
that torch can hold left out (pickle's ``persistent_id``), and their dtypes and shapes. Pickle,
not ``torch.utils._pytree``, walks the batch: it finds tensors inside every type a loader can
yield and keeps that type (pytree sees only into the containers registered with it: a
dataclass's tensors would be pickled), and a tensor that appears twice arrives once, twice
referenced. A numpy array travels as the tensor ``torch.from_numpy`` makes of it and comes
back as an array of the same dtype.

Gloo delivers a pair's messages in the order they were sent, so each pair of ranks is first in,
first out. Batches go on a gloo group of their own, and each point-to-point wait runs without a
timeout in a waiter thread while the calling thread watches the peers' heartbeats
(docs/design.md, "Batches handed over").
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddp_even.agreement.control_group import channel_for
from ddp_even.agreement.transport import CollectiveAgreer
from ddp_even.errors import EvenLoaderError

__all__ = ["Handover", "Incoming"]

# A batch's first message: the header's size (8 bytes), then as much of the header as fits.
# Gloo receives only a message of the size it expects, and each message the receiver must read
# before it knows what follows costs a round trip: one for most headers, not two.
_FIRST_BYTES = 1024
_FIRST_ROOM = _FIRST_BYTES - 8


class Handover:
    """Batches handed from one rank to another in mode share, over ddp_even's gloo group."""

    def __init__(self, agreer: CollectiveAgreer) -> None:
        """Every rank makes its Handover at the same point: the first one of a training group
        creates the group batches go on (a collective)."""
        self._agreer = agreer
        self._rank = agreer.rank
        self._group = agreer.handover_group()
        self._channel = channel_for(self._group)
        self._global_ranks = agreer.global_ranks
        # The sends not yet waited for (a gloo point-to-point work tells it completed only once
        # waited for), holding their messages until then: those before the last call of
        # release_received, and those since.
        self._sent_before: list[_Sent] = []
        self._sent: list[_Sent] = []
        # By group rank: the last batch asked for from there (the next one is received after it).
        self._receiving: dict[int, _Outcome] = {}

    def send(self, batch: Any, to_rank: int) -> None:
        """Start sending ``batch`` to group rank ``to_rank`` (agreer.rank numbering); returns at
        once.

        A batch that cannot go (it does not pickle, or holds a tensor off the CPU) raises here,
        and the receiver's ``receive`` raises ``EvenLoaderError`` naming this rank in its place.
        """
        try:
            header, tensors = _pack(batch)
        except Exception as error:
            # Told instead, so that the receiver never waits for a batch that will not come.
            refusal = pickle.dumps(_Unsendable(f"{type(error).__name__}: {error}"))
            self._post(_header_messages(refusal), to_rank)
            raise
        self._post([*_header_messages(header), *tensors], to_rank)

    def _post(self, messages: list[torch.Tensor], to_rank: int) -> None:
        destination = self._global_ranks[to_rank]
        works = []
        for message in messages:
            try:
                work = dist.isend(message, dst=destination, group=self._group)
            except RuntimeError as error:  # the peer's connection closed already
                self._agreer.await_peer(_in_thread(_raising(error)), to_rank)
                raise
            self._channel.track(work)
            works.append(work)
        self._sent.append(_Sent(to_rank, works, messages))

    def release_received(self) -> None:
        """Let go of the batches sent before the previous call, which the caller knows have
        been received (in share: every rank took them before it started the agreement that
        planned the window now sent), so that an epoch's sends are not all held. Their waits
        return at once, in this thread: no waiter thread is needed for them."""
        for sent in self._sent_before:
            _wait_all(sent.works)
        self._sent_before, self._sent = self._sent, []

    def expect(self, from_rank: int, count: int) -> list[Incoming]:
        """Start receiving the next ``count`` batches ``from_rank`` sends to this rank, after
        those expected from it before, in one waiter thread; returns at once. :meth:`collect`
        hands each out."""
        incoming = [Incoming(from_rank, _Outcome()) for _ in range(count)]
        if incoming:
            before = self._receiving.get(from_rank)
            self._receiving[from_rank] = incoming[-1].receiving
            source = self._global_ranks[from_rank]
            outcomes = [each.receiving for each in incoming]
            _waiters.run(functools.partial(self._receive_each, before, source, outcomes))
        return incoming

    def collect(self, incoming: Incoming) -> Any:
        """The batch ``incoming`` stands for; blocks until it is here."""
        self._agreer.await_peer(incoming.receiving, incoming.from_rank)
        batch = incoming.receiving.result
        if isinstance(batch, _Unsendable):
            raise EvenLoaderError(
                f"rank {self._global_ranks[incoming.from_rank]} could not hand a batch over to "
                f"rank {self._global_ranks[self._rank]}: {batch.error}"
            )
        return batch

    def finish(self) -> None:
        """Wait until every batch this rank started sending has been received (called at the
        end of the epoch, and when the epoch stops early)."""
        sending, self._sent_before, self._sent = [*self._sent_before, *self._sent], [], []
        # Taken off first: after a failure, a second finish does not wait for them again.
        for sent in sending:
            waiting = _in_thread(functools.partial(_wait_all, sent.works))
            self._agreer.await_peer(waiting, sent.to_rank)

    def _receive_each(self, before: _Outcome | None, source: int, outcomes: list[_Outcome]) -> None:
        """Receive a batch from global rank ``source`` into each of ``outcomes`` in turn, once
        the one asked for before them from there is in (in a waiter thread)."""
        for outcome in outcomes:
            outcome.settle(functools.partial(self._receive_after, before, source))
            before = outcome

    def _receive_after(self, before: _Outcome | None, source: int) -> Any:
        """One batch from global rank ``source`` once ``before`` is in (raising what it
        raised): the batch, or what its sender sent instead."""
        if before is not None:
            before.wait_done()
        header, tensors = self._receive_now(source)
        if isinstance(header, _Unsendable):
            return header
        return _Unpacker(io.BytesIO(header), tensors).load()

    def _receive_now(self, source: int) -> tuple[bytes | _Unsendable, list[Any]]:
        """One batch's messages, received and waited for."""
        first = torch.empty(_FIRST_BYTES, dtype=torch.uint8)
        _wait_all([dist.irecv(first, src=source, group=self._group)])
        size = int.from_bytes(first[:8].numpy().tobytes(), "little")
        header = first[8 : 8 + size].numpy().tobytes()
        if size > _FIRST_ROOM:
            rest = torch.empty(size - _FIRST_ROOM, dtype=torch.uint8)
            _wait_all([dist.irecv(rest, src=source, group=self._group)])
            header += rest.numpy().tobytes()
        unpacked = pickle.loads(header)
        if isinstance(unpacked, _Unsendable):
            return unpacked, []
        specs, body = unpacked
        tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in specs]
        _wait_all([dist.irecv(tensor, src=source, group=self._group) for tensor in tensors])
        arrays = [
            tensor.numpy().view(spec.numpy) if spec.numpy is not None else tensor
            for tensor, spec in zip(tensors, specs, strict=True)
        ]
        return body, arrays


@dataclass(frozen=True)
class _Sent:
    """A batch's sends to group rank ``to_rank``, and the messages they send (alive until the
    sends are waited for)."""

    to_rank: int
    works: list[Any]
    messages: list[torch.Tensor]


@dataclass(frozen=True)
class Incoming:
    """A batch on its way to this rank from group rank ``from_rank`` (:meth:`Handover.expect`)."""

    from_rank: int
    receiving: _Outcome


@dataclass(frozen=True)
class _Unsendable:
    """What a receiver is sent instead of a batch its sender could not pack."""

    error: str


@dataclass(frozen=True)
class _Spec:
    """What a receiver allocates for one tensor of a batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    # The numpy dtype it comes back as; None: it is a tensor.
    numpy: np.dtype[Any] | None


class _Packer(pickle.Pickler):
    """Pickles a batch with its tensors and numeric numpy arrays left out, to go as tensors."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.specs: list[_Spec] = []
        # By id: a tensor seen again goes once. The objects are kept, so no id is reused.
        self._seen: dict[int, tuple[int, Any]] = {}

    def persistent_id(self, obj: Any) -> int | None:
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[0]
        tensor = _as_tensor(obj)
        if tensor is None:
            return None
        index = len(self.tensors)
        self._seen[id(obj)] = (index, obj)
        self.tensors.append(tensor)
        numpy = obj.dtype if isinstance(obj, np.ndarray) else None
        self.specs.append(_Spec(tuple(tensor.shape), tensor.dtype, numpy))
        return index


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Any]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]


def _pack(batch: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header (the tensors' specs and the batch's pickle without them), and the tensors."""
    body = io.BytesIO()
    packer = _Packer(body)
    packer.dump(batch)
    header = pickle.dumps((packer.specs, body.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    return header, packer.tensors


def _header_messages(header: bytes) -> list[torch.Tensor]:
    first = bytearray(_FIRST_BYTES)
    first[:8] = len(header).to_bytes(8, "little")
    first[8 : 8 + min(len(header), _FIRST_ROOM)] = header[:_FIRST_ROOM]
    messages = [torch.frombuffer(first, dtype=torch.uint8)]
    if len(header) > _FIRST_ROOM:
        messages.append(torch.frombuffer(bytearray(header[_FIRST_ROOM:]), dtype=torch.uint8))
    return messages


def _as_tensor(obj: Any) -> torch.Tensor | None:
    """The contiguous CPU tensor ``obj`` travels as; None: it is pickled with the header."""
    if type(obj) is np.ndarray:
        if not obj.flags.c_contiguous:
            obj = obj.copy(order="C")
        try:
            with warnings.catch_warnings():
                # Only read, so an array that is not writable (pyarrow's) needs no copy.
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(obj)
        except (TypeError, ValueError):  # strings, objects, dates, another byte order
            return None
    # Subclasses (a Parameter) are pickled, so that they arrive as what they were.
    if type(obj) is not torch.Tensor or obj.layout != torch.strided:
        return None
    if obj.device.type != "cpu":
        raise EvenLoaderError(
            f"a batch handed over to another rank holds a tensor on {obj.device}: ddp_even "
            "hands over CPU tensors (move batches to the device after the loader)"
        )
    # A conjugate or negative view is resolved, a strided one copied: gloo sends memory as is.
    return obj.detach().resolve_conj().resolve_neg().contiguous()


class _Waiters:
    """Daemon threads that run blocking waits, kept for the next ones: starting a thread for
    each wait cost a small batch's hand-over 15 to 25 % more. A wait that never ends (a lost
    peer's) keeps its thread; the next wait gets another."""

    def __init__(self) -> None:
        self.forget_threads()

    def forget_threads(self) -> None:
        """None serves yet: at first, and in a forked child (it has none of its parent's)."""
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Threads that wait for a job.
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            threading.Thread(target=self._serve, name="ddp-even-handover", daemon=True).start()
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_waiters = _Waiters()
os.register_at_fork(after_in_child=_waiters.forget_threads)


class _Outcome:
    """What a blocking wait run in a waiter thread came to, waited for like a gloo work."""

    def __init__(self) -> None:
        self.result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def settle(self, wait: Callable[[], Any]) -> None:
        """Run ``wait`` (in a waiter thread) and keep what it returned or raised."""
        try:
            self.result = wait()
        except BaseException as error:  # raised by the thread that waits for this one
            self._error = error
        self._done.set()

    def wait(self, timeout: Any) -> bool:
        if not self._done.wait(timeout.total_seconds()):
            raise RuntimeError("still waiting")
        if self._error is not None:
            raise self._error
        return True

    def wait_done(self) -> None:
        """Wait without a timeout (in a waiter thread: the caller's thread watches the peers),
        raising what the wait raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done.is_set()


def _in_thread(wait: Callable[[], Any]) -> _Outcome:
    """Run ``wait`` in a waiter thread; its outcome."""
    outcome = _Outcome()
    _waiters.run(functools.partial(outcome.settle, wait))
    return outcome


def _wait_all(works: list[Any]) -> None:
    # Without a timeout: one that expires closes every connection of the gloo group.
    for work in works:
        work.wait()


def _raising(error: RuntimeError) -> Callable[[], None]:
    def fail() -> None:
        raise error

    return fail
