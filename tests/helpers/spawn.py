"""Run a function on N gloo ranks in spawned processes, with a hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, joins them into a gloo
process group (``file://`` rendezvous in a fresh temporary directory), calls
``fn(rank, world_size, *args)`` on each and returns the return values in rank order.

- ``fn`` and ``args`` must pickle: define ``fn`` at module level in an importable module
  (``tests/test_*.py`` is fine, ``tests`` is a package).
- A rank that raises makes ``run_ranks`` raise :class:`RankFailedError` (rank number, exception
  type, message and the rank's traceback in the message); the other ranks are SIGKILLed.
- With ``capture_exceptions=True`` every rank runs to the end and a rank that raised is reported
  as a :class:`RankError` in its slot of the returned list.
- Past ``timeout`` seconds every rank still running is SIGKILLed and ``TimeoutError`` names them
  and carries the Python stacks of all their threads (``faulthandler`` on ``SIGUSR1``) and the
  last lines ddp_even logged on every rank (each rank logs ddp_even's DEBUG records to a file).
  Where ``py-spy`` is found (``DDP_EVEN_PY_SPY``, the PATH, or beside the interpreter: the dev
  extra installs it), the native stacks too:
  what a process stuck in C++ (a gloo thread, a destructor) waits for.

The ranks start from torch.multiprocessing's fork server (the ``forkserver`` start method),
which has imported torch, ``torch._dynamo`` (the first optimizer of a process imports it) and
ddp_even once: a spawned rank spent about 5 s of CPU importing them, most of a short test's time.
Then it freezes its heap (``tests/helpers/frozen_heap.py``), so that no rank's garbage collector
walks those imports' objects again.
The fork server starts with ``OMP_NUM_THREADS=1`` (``tests/conftest.py``); pyarrow and petastorm
are not preloaded, since pyarrow starts a thread (jemalloc's) that a fork would not copy. Each
rank takes this process's environment as it is at ``run_ranks``, plus ``env``, as a spawned
one would; a variable read only when torch is imported is therefore the fork server's.

Each rank runs in its own process group, so processes a rank started are killed with it, and
dies with SIGKILL if the fork server dies, which it does when this process dies (Linux).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from tests.helpers import jitter

__all__ = ["RankError", "RankFailedError", "run_ranks"]

T = TypeVar("T")

_POLL_S = 0.05
# After a rank fails, how long to wait for the others' outcomes to find the earliest failure.
_GRACE_S = 1.0
_RESULT = "result-{rank}.pickle"
_STACKS = "stacks-{rank}.txt"
_LOG = "ddp-even-log-{rank}.txt"
_NATIVE = "native-stacks-{rank}.txt"
# What the fork server imports once for every rank (see the module's docstring); the last
# takes all of it out of the garbage collector's walks.
_PRELOADED = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.nn.parallel",
    "ddp_even",
    __name__,
    "tests.helpers.frozen_heap",
]
# Lines of each rank's ddp_even log a timeout shows.
_LOG_TAIL_LINES = 40
# How long a hung rank gets to write its stacks before it is killed.
_STACKS_WAIT_S = 2.0


@dataclass(frozen=True)
class RankError:
    """An exception a rank raised (or a rank that died without a result).

    Compares equal on ``type_name`` and ``message`` only, so tests can write
    ``assert results == [RankError("ValueError", "bad"), ...]``.
    """

    type_name: str
    message: str
    traceback: str = field(default="", compare=False, repr=False)


class RankFailedError(RuntimeError):
    """A rank raised; ``rank`` and ``error`` say which and what.

    ``others`` holds failures of other ranks seen at the same time (often consequences, such
    as gloo's "Connection closed by peer" on a rank waiting in a collective).
    """

    def __init__(
        self, rank: int, world_size: int, error: RankError, others: dict[int, RankError]
    ) -> None:
        self.rank = rank
        self.error = error
        self.others = others
        text = (
            f"rank {rank} of {world_size} raised {error.type_name}: {error.message}\n\n"
            f"--- rank {rank} traceback ---\n{error.traceback}"
        )
        for other, other_error in sorted(others.items()):
            text += f"\n(rank {other} also failed: {other_error.type_name}: {other_error.message})"
        super().__init__(text)


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _child(
    rank: int,
    world_size: int,
    payload: bytes,
    workdir: str,
    init_method: str,
    env: dict[str, str],
    pg_timeout: float | None,
    parent_pid: int,
) -> None:
    """Body of one rank's process."""
    os.setpgid(0, 0)
    _set_parent_death_signal()
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:  # run_ranks's process died before the death signal was armed
        os._exit(1)
    os.environ.clear()
    os.environ.update(env)
    # Kept open for the life of the process: faulthandler writes to its file descriptor.
    stacks = Path(workdir, _STACKS.format(rank=rank)).open("w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _log_ddp_even_to(Path(workdir, _LOG.format(rank=rank)))
    os.environ[jitter.RANK_VARIABLE] = str(rank)

    final = Path(workdir, _RESULT.format(rank=rank))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args = pickle.loads(payload)
        kwargs: dict[str, Any] = {}
        if pg_timeout is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=pg_timeout)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            **kwargs,
        )
        # init_process_group can return on one rank before a peer's gloo connectFullMesh is
        # done; a rank that then failed at once would break the peer's init. Start together.
        dist.barrier()
        try:
            outcome: tuple[str, Any, float] = ("ok", fn(rank, world_size, *args), time.time())
        except BaseException as exc:
            outcome = ("error", _rank_error(exc), time.time())
        # Written before leaving the group: peers waiting in a collective fail as soon as this
        # rank's connections close, and the parent must be able to see who failed first.
        _write_outcome(final, outcome)
        try:
            dist.destroy_process_group()
        except Exception as exc:
            if outcome[0] == "ok":
                _write_outcome(final, ("error", _rank_error(exc), time.time()))
    except BaseException as exc:
        _write_outcome(final, ("error", _rank_error(exc), time.time()))


def _log_ddp_even_to(path: Path) -> None:
    """Every DEBUG record of ddp_even in this rank, with a timestamp, to ``path``."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    library = logging.getLogger("ddp_even")
    library.addHandler(handler)
    library.setLevel(logging.DEBUG)


def _write_outcome(final: Path, outcome: tuple[str, Any, float]) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:
        error = _rank_error(exc, "the return value does not pickle: ")
        data = pickle.dumps(("error", error, outcome[2]))
    partial = final.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(final)


def _rank_error(exc: BaseException, prefix: str = "") -> RankError:
    return RankError(type(exc).__name__, prefix + str(exc), traceback.format_exc())


def _kill_group(proc: Any) -> None:
    """SIGKILL the rank and everything left in its process group.

    The group outlives the rank while a process it started runs, and Linux gives no new process
    a pid still in use as a process group id.
    """
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.exitcode is None:  # the fork server reaps an exited rank: its pid may be reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)  # not yet in its own group, or killpg refused


def _outcome(workdir: Path, rank: int, exitcode: int | None) -> tuple[str, Any, float]:
    """``(status, value or RankError, time.time() when fn returned or raised)``."""
    path = workdir / _RESULT.format(rank=rank)
    if path.exists():
        with path.open("rb") as f:
            result: tuple[str, Any, float] = pickle.load(f)
        return result
    if exitcode is not None and exitcode < 0:
        try:
            how = f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"signal {-exitcode}"
    else:
        how = f"exit code {exitcode}"
    # A rank that died hard sorts first: it is likelier the cause than its peers' errors.
    error = RankError("ProcessExited", f"rank {rank} died ({how}) without a result")
    return "error", error, float("-inf")


@overload
def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = ...,
    env: Mapping[str, str] | None = ...,
    capture_exceptions: Literal[False] = ...,
    pg_timeout: float | None = ...,
    tcp_store: bool = ...,
) -> list[T]: ...


@overload
def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = ...,
    env: Mapping[str, str] | None = ...,
    capture_exceptions: Literal[True],
    pg_timeout: float | None = ...,
    tcp_store: bool = ...,
) -> list[T | RankError]: ...


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    capture_exceptions: bool = False,
    pg_timeout: float | None = None,
    tcp_store: bool = False,
) -> list[T] | list[T | RankError]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; values in rank order.

    ``timeout`` bounds the whole run (start-up included). ``env`` is added to each child's
    environment before torch is imported there. ``pg_timeout`` (seconds) is passed to
    ``init_process_group`` (torch's default otherwise). ``tcp_store``: rendezvous through a
    TCP store hosted by rank 0's process (as ``env://`` and torchrun do) instead of a file.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))  # fails here, clearly, for lambdas and local functions

    import torch.multiprocessing as torch_mp

    ctx = torch_mp.get_context("forkserver")
    # Taken when this process's fork server starts, that is at its first run_ranks.
    ctx.set_forkserver_preload(_PRELOADED)
    rank_environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    workdir = Path(tempfile.mkdtemp(prefix="ddp-even-ranks-"))
    init_method = Path(workdir, "rendezvous").as_uri()
    if tcp_store:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    deadline = time.monotonic() + timeout
    procs: list[Any] = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_child,
                args=(
                    rank,
                    world_size,
                    payload,
                    str(workdir),
                    init_method,
                    rank_environment,
                    pg_timeout,
                    os.getpid(),
                ),
                name=f"ddp-even-rank-{rank}",
                daemon=False,
            )
            proc.start()
            procs.append(proc)
        outcomes = _collect(procs, workdir, deadline, timeout, capture_exceptions)
    finally:
        for proc in procs:
            _kill_group(proc)
        for proc in procs:
            proc.join(10)
        shutil.rmtree(workdir, ignore_errors=True)
    return [value for _, value, _ in outcomes]


def _collect(
    procs: list[Any],
    workdir: Path,
    deadline: float,
    timeout: float,
    capture_exceptions: bool,
) -> list[tuple[str, Any, float]]:
    world_size = len(procs)
    outcomes: dict[int, tuple[str, Any, float]] = {}
    pending = set(range(world_size))

    def reap_exited() -> None:
        for rank in sorted(pending):
            proc = procs[rank]
            if proc.exitcode is not None:  # read from the fork server, without waiting
                _kill_group(proc)  # whatever it left running; its pid is still reserved
                proc.join()
                pending.discard(rank)
                outcomes[rank] = _outcome(workdir, rank, proc.exitcode)

    while pending:
        reap_exited()
        if not capture_exceptions and any(out[0] == "error" for out in outcomes.values()):
            _raise_first_error(procs, workdir, outcomes, pending, deadline, reap_exited)
        if not pending:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _dump_stacks(procs, pending, workdir)
            raise TimeoutError(_timeout_message(procs, workdir, outcomes, pending, timeout))
        wait([procs[rank].sentinel for rank in pending], timeout=min(remaining, _POLL_S))
    return [outcomes[rank] for rank in range(world_size)]


def _raise_first_error(
    procs: list[Any],
    workdir: Path,
    outcomes: dict[int, tuple[str, Any, float]],
    pending: set[int],
    deadline: float,
    reap_exited: Callable[[], None],
) -> None:
    """Wait briefly for the other ranks' outcomes, then raise the earliest failure."""
    grace_end = min(deadline, time.monotonic() + _GRACE_S)
    while True:
        reap_exited()
        written = {
            rank: _outcome(workdir, rank, None)
            for rank in pending
            if (workdir / _RESULT.format(rank=rank)).exists()
        }
        if len(written) == len(pending) or time.monotonic() >= grace_end:
            break
        time.sleep(_POLL_S / 2)
    seen = {**outcomes, **written}
    errors = {rank: out for rank, out in seen.items() if out[0] == "error"}
    first = min(errors, key=lambda rank: (errors[rank][2], rank))
    others = {rank: out[1] for rank, out in errors.items() if rank != first}
    raise RankFailedError(first, len(procs), errors[first][1], others)


def _dump_stacks(procs: list[Any], pending: set[int], workdir: Path) -> None:
    """Ask each hung rank for its threads' stacks (see ``_child``) and give them time to write;
    with py-spy, take the native stacks too."""
    beside_python = Path(sys.executable).with_name("py-spy")
    py_spy = (
        os.environ.get("DDP_EVEN_PY_SPY")
        or shutil.which("py-spy")
        or (str(beside_python) if beside_python.exists() else None)
    )
    for rank in pending:
        if py_spy:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                native = subprocess.run(
                    [py_spy, "dump", "--native", "--pid", str(procs[rank].pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                Path(workdir, _NATIVE.format(rank=rank)).write_text(native.stdout + native.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_STACKS_WAIT_S)


def _timeout_message(
    procs: list[Any],
    workdir: Path,
    outcomes: dict[int, tuple[str, Any, float]],
    pending: set[int],
    timeout: float,
) -> str:
    lines = [
        f"run_ranks timed out after {timeout:g}s; ranks still running: {sorted(pending)} "
        f"(pids {[procs[rank].pid for rank in sorted(pending)]}), killed with SIGKILL"
    ]
    for rank in sorted(pending):
        if (workdir / _RESULT.format(rank=rank)).exists():
            lines.append(f"rank {rank} returned from fn but its process did not exit")
        stacks = workdir / _STACKS.format(rank=rank)
        if stacks.exists() and stacks.stat().st_size:
            lines.append(f"--- rank {rank} stacks ---\n{stacks.read_text()}")
        native = workdir / _NATIVE.format(rank=rank)
        if native.exists():
            lines.append(f"--- rank {rank} native stacks (py-spy) ---\n{native.read_text()}")
    for rank in range(len(procs)):
        log = workdir / _LOG.format(rank=rank)
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            lines.append(f"--- rank {rank}: ddp_even's last log lines ---\n" + "\n".join(tail))
    for rank, (status, value, _) in sorted(outcomes.items()):
        if status == "error":
            lines.append(f"rank {rank} had raised {value.type_name}: {value.message}")
            lines.append(value.traceback)
        else:
            lines.append(f"rank {rank} had finished")
    return "\n".join(lines)
