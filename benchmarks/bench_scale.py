"""ddp_even at scale on one machine: W spawned gloo ranks, for W in 8, 16, 32 and 64.

    python -m benchmarks.bench_scale                       # W = 8, 16, 32, 64: a table, JSON
    python -m benchmarks.bench_scale --ranks 8 --ranks 16  # some of them

Each W is first one job of W processes (spawned, each importing torch), joined in one gloo
process group through a ``TCPStore`` that rank 0 hosts, wrapped so that every rank counts the
requests it makes of the store (gloo's rendezvous, ddp_even's heartbeats and waiting readers).
Every rank, in turn:

1. creates the process group (the time to ``init_process_group``);
2. creates ddp_even's control group (its time apart), then trains a one-parameter DDP model
   one epoch in each mode (truncate, cycle, pad, join) over uneven in-memory shards (rank r:
   ``6 + r % 5`` batches): the steps each rank takes are checked against the mode's
   definition (the time to the first step);
   and over one Parquet dataset of ``2 W + 3`` uneven row groups read by the pyarrow reader,
   round robin and by equal row ranges, every mode, then a resume
   (:mod:`benchmarks.scale_parquet`: each checked against the mode's definition, the resumed
   epoch against the uninterrupted one);
3. agreement cost per step: the time of each ``next()`` of an epoch of 200 steps with no
   compute, agreeing every step (``sync_every=1``) and with known lengths (a list), medians and
   99th percentiles, and each epoch's collectives;
4. store requests per second over all ranks: while training (300 steps of 10 ms) and while
   every rank waits in an agreement for one rank that pauses 3 s.

Then one job of W ranks per fault, each on the plain ``TCPStore`` (as under ``env://`` and
torchrun: ddp_even reads the kernel about the process serving it), every survivor recording
when it raised what (:mod:`benchmarks.scale_faults`): a SIGKILL of the last rank just before its
third ``backward()`` (the DDP model averaging through ``ddp_even.allreduce_hook``), named
``dead``; a SIGSTOP of the last rank in a loop agreeing every step, named ``stalled``; and one
per Parquet reader (from_parquet's pyarrow reader; petastorm's ``make_batch_reader``, one
worker, where petastorm is installed) whose first loader, in cycle mode, creates ddp_even's
group under the short timeout, the last rank SIGKILLing itself before its third
``backward()``. Each gives the time from the fault to the last survivor's error, against the
loader's ``timeout`` (10 s), beside ``--hogs`` CPU hogs (busy loops, as ``scripts/soak.py``
runs): ranks starved of CPU while they create ddp_even's group, connect to the store and wait
for it are alive, and only the victim may be named.

Peak resident memory per rank (``ru_maxrss``). Where W stops (memory, time) the run says so
and what was measured before. On 2 cores every rank's process competes for them: times here
are the oversubscribed worst case, not what W GPUs on W hosts see.
"""

from __future__ import annotations

import collections
import datetime
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from benchmarks.report import write_results
from benchmarks.scale_faults import (
    fault_summary,
    kill_phase,
    parquet_kill_phase,
    stop_phase,
)
from benchmarks.scale_parquet import check_parquet, measure_parquet, write_dataset
from ddp_even.names import ModeName
from scripts.soak import busy_machine

MODES: tuple[ModeName, ...] = ("truncate", "cycle", "pad", "join")
AGREEMENT_STEPS = 200
# The loader's timeout for a silent peer in the fault phase (and its bound: + 5 s).
KILL_TIMEOUT_S = 10.0
# Everywhere else: long, so that a rank starved of CPU by 63 others is not taken for dead.
TIMEOUT_S = 60.0
JOB_LIMIT_S = 900.0
# CPU hogs beside the fault phases.
HOGS = 2


@dataclass(frozen=True)
class ScaleConfig:
    ranks: tuple[int, ...]
    agreement_steps: int = AGREEMENT_STEPS
    kill_timeout_s: float = KILL_TIMEOUT_S
    hogs: int = HOGS
    readers: tuple[str, ...] = ()


def shard_length(rank: int) -> int:
    return 6 + rank % 5


def _store_class() -> Any:
    import torch.distributed as dist

    class CountingStore(dist.Store):  # type: ignore[misc,name-defined]
        """The job's store, counting this process's requests of it."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.requests = 0

        def set(self, key: str, value: Any) -> None:
            self.requests += 1
            self.inner.set(key, value)

        def get(self, key: str) -> Any:
            self.requests += 1
            return self.inner.get(key)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self.requests += 1  # one request of a TCPStore, as ddp_even's readers make it
            return list(self.inner.multi_get(keys))

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self.requests += 1
            self.inner.multi_set(keys, values)

        def add(self, key: str, value: int) -> int:
            self.requests += 1
            return int(self.inner.add(key, value))

        def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
            self.requests += 1
            return self.inner.compare_set(key, expected, desired)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self.requests += 1
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            self.requests += 1
            return bool(self.inner.check(keys))

        def delete_key(self, key: str) -> bool:
            self.requests += 1
            return bool(self.inner.delete_key(key))

        def num_keys(self) -> int:
            return int(self.inner.num_keys())

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.inner.set_timeout(timeout)

    return CountingStore


def _quantile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _epoch_times(loader: Any, step_s: float = 0.0) -> list[float]:
    times: list[float] = []
    batches = iter(loader)
    while True:
        started = time.perf_counter()
        try:
            next(batches)
        except StopIteration:
            return times
        times.append(time.perf_counter() - started)
        if step_s:
            time.sleep(step_s)


def _job_store(rank: int, world_size: int, here: Path) -> Any:
    """The job's ``TCPStore``: rank 0 serves it on a port the system picks and writes it down,
    the others read it (a port picked free in advance may be taken by another job on the
    machine before rank 0 binds it: rank 0 failed, and the others waited 10 minutes)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    published = here / "store_port"
    if rank == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False
        )
        here.joinpath("store_port.part").write_text(str(store.port))
        here.joinpath("store_port.part").rename(published)  # whole, or not there
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 did not start the job's store")
        time.sleep(0.05)
    port = int(published.read_text())
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world_size, False, timeout=timeout
    )


def _rank_main(rank: int, world_size: int, workdir: str, phase: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    out = Path(workdir, f"rank-{rank}.json")
    try:
        started = time.perf_counter()
        inner = _job_store(rank, world_size, Path(workdir))
        # Counted in the measuring job; the faults see the plain TCPStore, as a user's job does.
        store = _store_class()(inner) if phase == "main" else inner
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )  # fmt: skip
        result["group_s"] = time.perf_counter() - started
        dist.barrier()
        if phase == "kill":
            shard = [torch.full((4, 1), float(rank))] * shard_length(rank)
            result["fault"] = kill_phase(rank, world_size, shard, Path(workdir), KILL_TIMEOUT_S)
        elif phase == "stop":
            result["fault"] = stop_phase(rank, world_size, Path(workdir), KILL_TIMEOUT_S)
        elif phase.startswith("kill-"):
            dataset = Path(workdir, "scale.parquet")
            result["fault"] = parquet_kill_phase(
                rank, world_size, dataset, Path(workdir), KILL_TIMEOUT_S, phase[5:]
            )
        else:
            _measure(rank, world_size, store, result, Path(workdir))
    except BaseException as error:  # written down: the parent reads every rank's outcome
        result["error"] = f"{type(error).__name__}: {error}"[:500]
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps(result))
    # After the SIGKILL the group cannot be destroyed cleanly: leave at once.
    os._exit(0)


def _measure(rank: int, world_size: int, store: Any, result: dict[str, Any], here: Path) -> None:
    import torch
    import torch.distributed as dist

    from ddp_even import EvenLoader
    from ddp_even.agreement.control_group import control_group_for

    calls = collections.Counter[str]()
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def counted(name: str, collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return collective(*args, **kwargs)

        return call

    dist.all_reduce = counted("all_reduce", real_all_reduce)
    dist.all_gather = counted("all_gather", real_all_gather)
    shard = [torch.full((4, 1), float(rank))] * shard_length(rank)

    # 2. ddp_even's control group (the first loader's first batch would create it), then every
    # mode, one epoch each, in memory and over Parquet.
    started = time.perf_counter()
    control_group_for(None, TIMEOUT_S)
    result["control_group_s"] = time.perf_counter() - started
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    steps = {}
    for mode in MODES:
        joinables = [model] if mode == "join" else []
        loader: EvenLoader[Any] = EvenLoader(
            shard, mode, timeout=TIMEOUT_S, joinables=joinables, sync_every=1
        )
        started, count = time.perf_counter(), 0
        for batch in loader:
            if count == 0 and mode == MODES[0]:
                result["first_step_s"] = time.perf_counter() - started
            model(batch).sum().backward()
            count += 1
        steps[mode] = count
    result["steps"] = steps
    result["parquet"] = measure_parquet(
        here / "scale.parquet", lambda inputs: model(inputs).sum().backward(), [model], TIMEOUT_S
    )

    # 3. The agreement's cost per step, and the collectives of an epoch.
    long_shard = [torch.zeros(1)] * (AGREEMENT_STEPS + rank % 3)
    for name, sync_every in (("every_step", 1), ("known", None)):
        loader = EvenLoader(long_shard, "truncate", sync_every=sync_every, timeout=TIMEOUT_S)
        _epoch_times(loader)  # a warm-up epoch
        before = sum(calls.values())
        times = _epoch_times(loader)
        result[name] = {
            "median_us": statistics.median(times) * 1e6,
            "p99_us": _quantile(times, 0.99) * 1e6,
            "collectives": sum(calls.values()) - before,
        }

    # 4. Store requests per second over all ranks: training, then waiting for a pause. Every
    # rank runs the whole epoch: a loop left on some ranks only would leave the others waiting.
    def requests_during(steps: int, step_s: float, paused: bool) -> float:
        loader: EvenLoader[Any] = EvenLoader(
            [torch.zeros(1)] * steps, "truncate", sync_every=1, timeout=TIMEOUT_S
        )
        dist.barrier()
        before, started = store.requests, time.perf_counter()
        for step, _ in enumerate(loader):
            if paused and step == steps // 2 and rank == world_size - 1:
                time.sleep(3.0)
            time.sleep(step_s)
        rate = torch.tensor([(store.requests - before) / (time.perf_counter() - started)])
        dist.all_reduce(rate)
        return float(rate.item())

    result["store_requests_per_s"] = {
        "training": requests_during(300, 0.01, paused=False),
        "waiting": requests_during(20, 0.0, paused=True),
    }


def available_readers() -> tuple[str, ...]:
    """The Parquet readers of the kill jobs: pyarrow's, and petastorm's where installed."""
    try:
        import petastorm  # noqa: F401
    except ImportError:
        return ("arrow",)
    return ("arrow", "petastorm")


def run_world(
    world_size: int, hogs: int = HOGS, readers: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The jobs of ``world_size`` ranks (measures; a SIGKILL, a SIGSTOP, a SIGKILL per Parquet
    reader, each beside ``hogs`` CPU hogs), summed up."""
    summary = _run_job(world_size, "main", hogs)
    summary["hogs"] = hogs
    if "group_s" in summary:
        faults = ["kill", "stop"]
        faults += [
            f"kill-{reader}" for reader in (available_readers() if readers is None else readers)
        ]
        for phase in faults:
            ended = _run_job(world_size, phase, hogs)
            summary[phase.replace("-", "_")] = ended.get("fault") or {
                "named": False,
                "outcomes": ended,
            }
    return summary


def _run_job(world_size: int, phase: str, hogs: int) -> dict[str, Any]:
    """One job of ``world_size`` ranks doing ``phase``; what each rank measured, summed up."""
    os.environ["OMP_NUM_THREADS"] = "1"
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as workdir:
        write_dataset(Path(workdir), world_size)
        started = time.perf_counter()
        ranks = [
            context.Process(target=_rank_main, args=(rank, world_size, workdir, phase))
            for rank in range(world_size)
        ]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + JOB_LIMIT_S
        with busy_machine(0 if phase == "main" else hogs):
            for process in ranks:
                process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        for process in ranks:
            if process.is_alive():
                process.kill()
        results = [
            json.loads(path.read_text())
            for path in sorted(Path(workdir).glob("rank-*.json"), key=lambda p: int(p.stem[5:]))
        ]
        fault_mark = Path(workdir, "fault_at")
        fault_at = float(fault_mark.read_text()) if fault_mark.exists() else None
        seconds = time.perf_counter() - started
    if phase != "main":
        survivors = [result for result in results if result["rank"] != world_size - 1]
        faults = [result["fault"] for result in survivors if "fault" in result]
        if hung or len(faults) < world_size - 1:
            return {"hung": hung, "errors": [result.get("error") for result in results]}
        state = "stalled" if phase == "stop" else "dead"
        return {"fault": fault_summary(faults, world_size - 1, state, fault_at)}
    return summarize(world_size, results, hung, seconds)


def _expected_steps(world_size: int) -> dict[str, list[int]]:
    lengths = [shard_length(rank) for rank in range(world_size)]
    return {
        "truncate": [min(lengths)] * world_size,
        "cycle": [max(lengths)] * world_size,
        "pad": [max(lengths)] * world_size,
        "join": lengths,
    }


def summarize(
    world_size: int,
    results: list[dict[str, Any]],
    hung: list[int],
    seconds: float,
) -> dict[str, Any]:
    errors = {result["rank"]: result["error"] for result in results if "error" in result}
    summary: dict[str, Any] = {
        "world_size": world_size,
        "seconds": seconds,
        "ranks_reported": len(results),
        "hung": hung,
        "errors": errors,
    }
    if errors or len(results) < world_size:
        return summary
    expected = _expected_steps(world_size)
    summary["modes_as_defined"] = all(
        [result["steps"][mode] for result in results] == expected[mode] for mode in MODES
    )
    summary["parquet_wrong"] = check_parquet(results, world_size)
    summary["group_s"] = max(result["group_s"] for result in results)
    summary["control_group_s"] = max(result["control_group_s"] for result in results)
    summary["first_step_s"] = max(result["first_step_s"] for result in results)
    for name in ("every_step", "known"):
        summary[name] = {
            "median_us": statistics.median(result[name]["median_us"] for result in results),
            "p99_us": max(result[name]["p99_us"] for result in results),
            "collectives": results[0][name]["collectives"],
        }
    summary["store_requests_per_s"] = results[0]["store_requests_per_s"]
    summary["peak_rss_mib"] = max(result["peak_rss_mib"] for result in results)
    return summary


def results_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(title=f"ddp_even on W gloo ranks of one machine ({os.cpu_count()} CPUs)")
    for column in (
        "W", "group s", "control group s", "first step s", "modes", "Parquet, resume",
        "K=1 median / p99", "known median / p99", "collectives K=1 / known",
        "store req/s train / wait", "SIGKILL → last error", "SIGSTOP → last error",
        "SIGKILL, Parquet: pyarrow / petastorm",
        "peak RSS/rank", "job s",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for run in runs:
        if "group_s" not in run:
            table.add_row(str(run["world_size"]), f"failed: {run['errors'] or run['hung']}")
            continue
        every, known = run["every_step"], run["known"]
        rates = run["store_requests_per_s"]
        table.add_row(
            str(run["world_size"]),
            f"{run['group_s']:.1f}",
            f"{run['control_group_s']:.1f}",
            f"{run['first_step_s']:.1f}",
            "as defined" if run["modes_as_defined"] else "WRONG",
            "as defined" if not run["parquet_wrong"] else "WRONG",
            f"{every['median_us']:.0f} / {every['p99_us']:.0f} us",
            f"{known['median_us']:.0f} / {known['p99_us']:.0f} us",
            f"{every['collectives']} / {known['collectives']}",
            f"{rates['training']:.0f} / {rates['waiting']:.0f}",
            _fault_cell(run["kill"]),
            _fault_cell(run.get("stop", {"named": False})),
            " / ".join(
                _fault_cell(run[f"kill_{reader}"]) if f"kill_{reader}" in run else "-"
                for reader in ("arrow", "petastorm")
            ),
            f"{run['peak_rss_mib']:.0f} MiB",
            f"{run['seconds']:.0f}",
        )
    table.caption = (
        f"known lengths: {AGREEMENT_STEPS} steps; faults: the loader's timeout "
        f"{KILL_TIMEOUT_S:g} s, beside {runs[0].get('hogs', HOGS) if runs else HOGS} CPU hogs"
    )
    return table


def _fault_cell(fault: dict[str, Any]) -> str:
    seconds = fault.get("to_last_error_s")
    return "not named" if seconds is None else f"{seconds:.1f} s"


@click.command()
@click.option("--ranks", multiple=True, type=click.IntRange(2), help="[default: 8 16 32 64]")
@click.option("--hogs", type=click.IntRange(0), default=HOGS, show_default=True,
              help="CPU hogs (busy loops) beside the fault phases")  # fmt: skip
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/scale.json"),
    show_default=True,
)
def main(ranks: tuple[int, ...], hogs: int, out: Path) -> None:
    """Every guarantee's cost as W grows: group creation, agreement, store load, a death."""
    console = Console() if sys.stdout.isatty() else Console(width=200)
    config = ScaleConfig(ranks or (8, 16, 32, 64), hogs=hogs, readers=available_readers())
    runs = []
    for world_size in config.ranks:
        console.print(f"W = {world_size} ...")
        run = run_world(world_size, hogs, config.readers)
        runs.append(run)
        if "group_s" not in run:
            console.print(f"W = {world_size} stopped: {run['errors'] or run['hung']}")
            break
    console.print(results_table(runs))
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
