"""DDP's gradient all-reduce as a communication hook that names a peer lost in it.

A rank that dies while the others are inside DDP's own all-reduce of the gradients never
passes through ddp_even's code: the survivors get gloo's ``RuntimeError`` from ``backward()``,
which names no rank. :func:`allreduce_hook` does what DDP does without a hook and, when a
bucket's all-reduce fails, raises :class:`~ddp_even.PeerTimeoutError` naming the lost peer from
``backward()``, on every survivor: from a callback queued on the autograd engine, since an
exception raised in a bucket's future reaches the user only as a ``RuntimeError`` carrying its
text (``docs/design.md``, "DDP's own all-reduce").

Torch internals relied on (torch 2.13; ``tests/test_gradient_hook.py`` fails first if they
change):

* ``torch.autograd.Variable._execution_engine.queue_callback``: the engine's "run this when
  the backward pass ends", which DDP's reducer itself uses; outside a backward pass it raises
  ``RuntimeError``.
* ``torch._C._distributed_c10d.GradBucket``: the class ``torch.distributed`` re-exports as
  ``GradBucket``, imported from where its type information is; DDP refuses a hook whose
  ``bucket`` annotation is anything else.
* ``DistributedDataParallel._comm_hooks``: the hooks registered on a model, read by
  :func:`register_on` before it registers one (a second registration raises, after changing
  the model's records).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from ddp_even.errors import EvenLoaderError
from ddp_even.liveness.heartbeat import loader_timeout
from ddp_even.liveness.peers import (
    DEAD,
    GONE_EXITED,
    QUIET_S,
    Board,
    Verdict,
    Watch,
    connection_lost,
    current_watch,
    lost_peers,
    poll_interval,
    store_host,
    verdict_on,
)
from ddp_even.process_group import training_timeout

logger = logging.getLogger("ddp_even")

WHAT = "DDP's gradient all-reduce"
# This backward pass's bucket all-reduces not yet waited for, and their failures (written by
# gloo's thread).
_pending: list[tuple[torch.futures.Future[torch.Tensor], dist.ProcessGroup | None]] = []
_failures: list[tuple[RuntimeError, dist.ProcessGroup | None]] = []
# After a dead peer's heartbeat has had ``timeout`` to stop: the last look at the peers.
_LAST_LOOK_S = 1.0


def allreduce_hook(
    state: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of the gradients; a rank lost in it is named by ddp_even's error.

    Register it on the DDP model (``state``: the process group to average over, ``None`` for
    the default one, as torch's own ``allreduce_hook`` takes it). The gradients are those of
    DDP without a hook. If a peer dies while this rank waits in the all-reduce, ``backward()``
    raises :class:`~ddp_even.PeerTimeoutError` naming it (``states`` ``{rank: "dead"}``),
    within the loader's ``timeout`` and about 2 s, instead of gloo's error; every survivor
    names the same rank. A frozen peer (SIGSTOP) is named ``"stalled"`` when gloo gives up on
    it, after the training group's timeout. The peers are told apart by the heartbeats of
    ddp_even's loaders: in a process where no ``EvenLoader`` has started, the failure is an
    :class:`~ddp_even.EvenLoaderError` quoting gloo.

    In Lightning, ``DDPStrategy(ddp_comm_hook=allreduce_hook)``; with accelerate, register it
    on the model ``accelerator.prepare`` returns.

    Example, on every rank (``tests/test_gradient_hook.py`` runs it on 2 and 3 ranks)::

        model = DistributedDataParallel(net)
        model.register_comm_hook(None, ddp_even.allreduce_hook)

    In a job of one process::

        >>> import torch, torch.distributed as dist, ddp_even
        >>> store = dist.HashStore()
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> model.register_comm_hook(None, ddp_even.allreduce_hook)
        >>> model(torch.ones(4, 2)).sum().backward()
        >>> model.module.bias.grad
        tensor([4.])
        >>> del model  # before the group: see "Ending a job" in docs/using.md
        >>> dist.destroy_process_group()
    """
    group = state
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    reduced = dist.all_reduce(buffer, group=group, async_op=True)
    assert reduced is not None  # async_op=True always returns the work
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_raise_failure)
    except RuntimeError:  # outside a backward pass: Join's shadow all-reduce
        averaged = reduced.get_future().then(lambda done: _value_or_named_failure(done, group))
    else:
        averaged = reduced.get_future().then(
            lambda done: _value_or_failure_kept(done, group, buffer)
        )
        _pending.append((averaged, group))
    return cast(torch.futures.Future[torch.Tensor], averaged)


def register_on(model: object) -> bool:
    """Make a DDP ``model`` average its gradients through :func:`allreduce_hook`; True if it
    does now. A model with a communication hook of its own keeps it (logged once); anything
    but a ``DistributedDataParallel`` is left alone.

    Example::

        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> register_on(model), register_on(model), register_on(torch.nn.Linear(2, 1))
        (True, True, False)
        >>> del model
        >>> dist.destroy_process_group()
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    hooks = [hook for hook, _ in model._comm_hooks]
    if allreduce_hook in hooks:
        return True
    if hooks:
        logger.info(
            "ddp_even: the DDP model has a communication hook of its own (%s): a rank that dies "
            "inside its gradient all-reduce is not named by ddp_even",
            getattr(hooks[0], "__qualname__", hooks[0]),
        )
        return False
    try:
        model.register_comm_hook(model.process_group, allreduce_hook)
    except RuntimeError as error:  # a built-in hook, which the model does not list
        model._comm_hooks.pop()
        logger.info("ddp_even: allreduce_hook not registered on the DDP model: %s", error)
        return False
    logger.debug("ddp_even: the DDP model's gradients are averaged through allreduce_hook")
    return True


def _value_or_failure_kept(
    done: torch.futures.Future[list[torch.Tensor]],
    group: dist.ProcessGroup | None,
    buffer: torch.Tensor,
) -> torch.Tensor:
    try:
        return done.value()[0]
    except RuntimeError as error:
        # Raised at the end of the backward pass by _raise_failure; the buffer's values never
        # reach a parameter, since the optimizer step is not taken.
        _failures.append((error, group))
        return buffer


def _value_or_named_failure(
    done: torch.futures.Future[list[torch.Tensor]], group: dist.ProcessGroup | None
) -> torch.Tensor:
    try:
        return done.value()[0]
    except RuntimeError as error:
        raise named_failure(error, group) from error


def _raise_failure() -> None:
    while _pending:
        _wait_watching(*_pending.pop())  # never raises gloo's failure: kept in _failures
    if _failures:
        error, group = _failures[0]
        _failures.clear()
        raise named_failure(error, group) from error


def _wait_watching(
    averaged: torch.futures.Future[torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """Wait for one bucket's all-reduce; past :data:`QUIET_S`, also for another survivor's
    verdict or a peer whose process is gone or exited, raised at once (gloo fails a survivor
    only when one of its own connections closes); a live or frozen peer is left to gloo's
    timeout."""
    timeout = loader_timeout()
    if averaged.done() or timeout is None:  # most buckets of most steps: no watching to set up
        averaged.wait()
        return
    finished = threading.Event()
    averaged.add_done_callback(lambda _: finished.set())
    if finished.wait(QUIET_S):
        averaged.wait()
        return
    board, ranks, peers = _survivors(group)
    me, watch = board.rank, board.watch
    while not finished.wait(poll_interval(timeout, len(ranks))):
        verdict = board.read()
        if verdict is None:
            views = watch.look(peers) or {}
            gone = {
                rank: state
                for rank, state in lost_peers(views, timeout).items()
                if state in (DEAD, GONE_EXITED)
            }
            if gone:
                verdict = board.publish(verdict_on(views, gone, by=me, timeout=timeout, what=WHAT))
        if verdict is not None:
            logger.debug("%s given up: %s", WHAT, verdict)
            _pending.clear()
            _failures.clear()
            raise board.adopt(verdict, len(ranks))
    averaged.wait()


def named_failure(error: RuntimeError, group: dist.ProcessGroup | None) -> EvenLoaderError:
    """Which peer the failed all-reduce lost: the verdict of the first survivor to find one lost
    in the heartbeats (looked at until one is, or for the loader's ``timeout`` and a second),
    written to the store so that every survivor names the same (a survivor that raised and
    exited is not what the others lost)."""
    from ddp_even.liveness.verdict import gloo_words

    gloo = gloo_words(str(error))
    timeout = loader_timeout()
    if timeout is None:
        return EvenLoaderError(
            f"rank {dist.get_rank()}: {WHAT} failed, and which peer it lost is unknown: no "
            "EvenLoader has started in this process, so there are no heartbeats to read; "
            f"gloo: {gloo}"
        )
    board, ranks, peers = _survivors(group)
    me, watch = board.rank, board.watch
    lost_connection = connection_lost(gloo)
    give_up = time.monotonic() + timeout + _LAST_LOOK_S
    # A store that does not answer while its serving process runs is busy, not a reason to
    # give up on naming the peer: waited for up to the training group's timeout.
    patience = time.monotonic() + max(training_timeout(group), timeout)
    while (verdict := board.read()) is None:
        verdict = _look(watch, peers, str(error), me, timeout, lost_connection)
        store_busy = watch.silent_since() is not None and time.monotonic() < patience
        if verdict is None and time.monotonic() >= give_up and not store_busy:
            detail = f"every peer's heartbeat went on for {timeout:g} s after the failure"
            verdict = Verdict(me, (), {}, timeout, WHAT, detail)
        if verdict is not None:
            verdict = board.publish(replace(verdict, detail=f"{verdict.detail}; gloo: {gloo}"))
            break
        time.sleep(poll_interval(timeout, len(ranks)))
    logger.debug("%s failed: %s", WHAT, verdict)
    return board.adopt(verdict, len(ranks))


def _look(
    watch: Watch, peers: list[int], gloo_message: str, me: int, timeout: float, lost: bool
) -> Verdict | None:
    """The verdict on the peers found lost in their heartbeats now, or None."""
    views = watch.look(peers)
    if views is None:
        from ddp_even.liveness.verdict import store_host_gone, store_silence

        unknown = f"the job's store did not answer ({watch.store_error!r})"
        verdict = store_host_gone(watch, gloo_message, unknown, peers, me, timeout, WHAT)
        return verdict or store_silence(watch, by=me, timeout=timeout, what=WHAT)
    states = lost_peers(views, timeout, connection_lost=lost)
    return verdict_on(views, states, by=me, timeout=timeout, what=WHAT) if states else None


def _survivors(group: dist.ProcessGroup | None) -> tuple[Board, Sequence[int], list[int]]:
    """Where the survivors of a failed gradient all-reduce in ``group`` (the world by default)
    write the one verdict they all raise; the group's global ranks, and this rank's peers."""
    training_group = group or dist.group.WORLD
    assert training_group is not None  # a hook runs only in a process group
    me = dist.get_rank()
    prefix = f"ddp_even/{training_group.group_name}/gradients/"
    board = Board(current_watch(), prefix, me, store_host() == me)
    ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    return board, ranks, [rank for rank in ranks if rank != me]
