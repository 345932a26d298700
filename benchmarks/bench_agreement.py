"""What keeping uneven DDP ranks in step costs per training step: ddp_even against the others.

    python -m benchmarks.bench_agreement            # 2 and 4 ranks, tables, bench-results/
    python -m benchmarks.bench_agreement --quick    # 2 ranks, a smoke run of under a minute

Each ``--ranks`` value starts that many CPU processes joined in one gloo process group. Every
rank first measures the latency of one blocking ``all_reduce`` of a single int64 (median of
many), then runs, side by side on the same pre-made batches, the same models and the same
process group, every variant under three workloads:

* ``loader``: no compute, the loop only takes batches;
* ``ddp model``: a small DDP model (two Linear layers): forward, backward, SGD step;
* ``busy wait``: a busy-wait of twice the measured all-reduce latency per step: a step that
  keeps the loop's core busy (CPU training);
* ``idle wait``: a sleep of the same length: a step that leaves the core free, as a GPU step
  does while the host waits for the device.

Variants:

* ``floor``: shards made equal by hand, a plain loop, no wrapper, no collective;
* ``floor, DDP through allreduce_hook`` (the ``ddp model`` workload): the floor with the DDP
  model averaging through ``ddp_even.allreduce_hook`` instead of DDP's built-in all-reduce;
* the hand-written loops, each doing the collectives of the ddp_even row it is compared with,
  the epoch's boundaries included (an agreement of two int64s before the first batch, the
  ranks' counts gathered after the last, as ddp_even does): ``hand-written blocking flag``
  (a blocking all-reduce of "I have a batch" before every step); ``hand-written overlapped
  count K=1`` and ``K=16`` (a window's batch count all-reduced, async, one batch before it is
  needed: the least an overlapped agreement per step or per 16 steps costs, without checks or
  bookkeeping); ``hand-written known lengths`` (the counts agreed once, then an async check
  every 16 steps and after the last, each waited for at the next: ddp_even's known lengths
  with its checks 16 steps apart);
* ``torch Join over DDP``: without a model in the workload (``loader``, the waits) it runs
  over a one-parameter DDP model whose step is added to the workload, and is compared with
  ``floor + 1-param DDP``, the same step on equal shards. Join's model is an identical DDP
  instance of its own: Join leaves its joinables' join all-reduces on after it exits;
* ddp_even truncate and cycle agreeing every step (K=1, overlapped with the step) and every 16
  steps (K=16); pad the same (over lists, without a plan, each agreement comes with a sum of
  the window's real rows: a second collective, started with it); ddp_even with known lengths
  (a list source, ``sync_every=None``: one agreement per epoch, and a check of the sources
  every ``CHECK_EVERY`` steps, further apart where steps are short (``runtime/settings.py``),
  and after the last), the same with a check every ``CHECK_EVERY`` steps whatever the steps
  take (beside the hand-written known lengths) and with only the check after the last step:
  the differences are what the spacing saves and what the checks cost;
* ``ddp_even truncate K=1 (two int64s)``: every agreement in the long form only (one
  ``all_reduce(MAX)`` of two int64s), beside ``ddp_even truncate K=1``, whose windows go in the
  short form (one int64, ``all_reduce(BOR)``): what the short form saves.

Shards are uneven: rank r has ``steps * (1 - 0.1 r)`` batches. The floor takes, on every rank,
as many steps as truncate does, so per-step times compare. One epoch of every variant runs per
round, the variants interleaved and their order turned by one each round (A B C, B C A, ...);
round 0 is a warm-up and is discarded (it creates ddp_even's gloo group).

Reading the table (all per step, rank 0, medians over rounds):

* ``per step``: the whole epoch's wall time, from asking for the first batch to the loop's end
  (the epoch's opening agreement and its closing statistics included), over its steps;
  ``CPU / step``: the same for the CPU time of the whole process (every thread: gloo's too),
  which holds on shared cores where wall time does not;
* ``added`` and ``added CPU``: those minus the floor's (for Join without a model in the
  workload: minus ``floor + 1-param DDP``'s);
* ``collectives``: Python-level collective calls (``torch.distributed.all_reduce``,
  ``all_gather``, ...; DDP's gradient buckets, issued from C++, are not counted) in the whole
  epoch, and ``in loop``: between the first and the last batch.

The run ends with the targets as PASS/FAIL lines, per workload: truncate at ``sync_every=1``
at most 1.2x the CPU per step of the hand-written overlapped count K=1 (the same collectives),
and known lengths at most 10 us of CPU per step over the floor, the epoch's boundaries
included; and, from the collective counts, that a known-lengths epoch checks its sources at
most every ``CHECK_EVERY`` steps and after the last. The JSON has every round's numbers.
Differences of a few microseconds need a quiet machine: the caption gives the load average.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ranks import COLLECTIVE_TIMEOUT_S, in_turn, run_on_ranks
from benchmarks.report import warn_if_loaded, write_results
from ddp_even import EvenLoader, allreduce_hook
from ddp_even.agreement.transport import CollectiveAgreer
from ddp_even.runtime import settings as check_settings

Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], None]

FLOOR = "floor"
FLOOR_TINY_DDP = "floor + 1-param DDP"
JOIN = "torch Join over DDP"
HOOKED = "floor, DDP through allreduce_hook"
# The known-lengths variants whose only check of the sources is the one after the last step,
# and whose checks are every CHECK_EVERY steps whatever the steps take.
ONE_CHECK = "(one check, after the last step)"
EVERY_16 = f"(a check every {check_settings.CHECK_EVERY} steps)"
LONG_ONLY = "ddp_even truncate K=1 (two int64s)"
OVERLAPPED = "hand-written overlapped count "
HAND_KNOWN = f"hand-written known lengths {EVERY_16}"
ELEMENT_COUNTS = (1, 2, 9)
BUSY_WAIT = "busy wait"
IDLE_WAIT = "idle wait"
COUNTED_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
)
COLUMNS = ("steps", "per step", "CPU / step", "added", "added CPU", "collectives", "in loop")


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 96
    repeats: int = 5
    batch_size: int = 32
    features: int = 64
    outputs: int = 10
    window: int = 16
    latency_samples: int = 400


@dataclass(frozen=True)
class EpochTiming:
    """One epoch of one variant on rank 0, its boundaries included, per step."""

    steps: int
    per_step_s: float
    # CPU time of the whole process (every thread, gloo's too) per step.
    cpu_per_step_s: float
    collectives: int
    collectives_in_loop: int


@dataclass
class Variant:
    name: str
    # What its added time is measured against.
    reference: str
    batches: Callable[[], Iterable[Batch]]
    step: Step
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    timings: list[EpochTiming] = field(default_factory=list)


class CollectiveCounter:
    """Counts calls of the public ``torch.distributed`` collectives in this process."""

    def __init__(self) -> None:
        self.calls = 0

    def install(self) -> None:
        for name in COUNTED_COLLECTIVES:
            setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return collective(*args, **kwargs)

        return counted


def timed_epoch(batches: Iterable[Batch], step: Step, counter: CollectiveCounter) -> EpochTiming:
    """The whole epoch, from asking for the first batch to the loop's end (an agreement that
    opens the epoch and statistics that close it included), over its steps."""
    calls_at_start = counter.calls
    first_calls: int | None = None
    last_calls = 0
    steps = 0
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    for batch in batches:
        last_calls = counter.calls
        if first_calls is None:
            first_calls = last_calls
        step(batch)
        steps += 1
    wall_s, cpu_s = time.perf_counter() - started_s, time.process_time() - started_cpu_s
    if first_calls is None:
        raise RuntimeError("the epoch yielded no batch")
    return EpochTiming(
        steps=steps,
        per_step_s=wall_s / steps,
        cpu_per_step_s=cpu_s / steps,
        collectives=counter.calls - calls_at_start,
        collectives_in_loop=last_calls - first_calls,
    )


def allreduce_times_s(samples: int, elements: int = 1) -> list[float]:
    """Times of ``samples`` blocking all_reduces (MAX) of ``elements`` int64s, one after the
    other, on the world (gloo) group."""
    value = torch.zeros(elements, dtype=torch.int64)
    for _ in range(samples // 10):
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter() - start)
    return times


def allreduce_means_by_elements_s(samples: int, rounds: int = 5) -> dict[str, float]:
    """Why ddp_even's agreement is one or two packed int64s, not a readable vector: the mean
    time of an all-reduce of each of :data:`ELEMENT_COUNTS` int64s, the counts taken in turn
    for ``rounds`` rounds (the machine's pace drifts). The mean, not the median: larger
    messages mostly add slow calls, and a loop pays for every call."""
    times: dict[int, list[float]] = {elements: [] for elements in ELEMENT_COUNTS}
    for _ in range(rounds):
        for elements in ELEMENT_COUNTS:
            times[elements] += allreduce_times_s(samples // rounds, elements)
    return {str(elements): statistics.fmean(taken) for elements, taken in times.items()}


def rank_0s(value: float) -> float:
    """Rank 0's ``value`` on every rank (every rank must wait the same time per step)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return float(tensor.item())


def busy_wait(seconds: float) -> Step:
    def step(batch: Batch) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return step


def idle_wait(seconds: float) -> Step:
    def step(batch: Batch) -> None:
        time.sleep(seconds)

    return step


def no_compute(batch: Batch) -> None:
    pass


def training_step(model: nn.Module, inputs: int, outputs: int) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: Batch) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(model(x[:, :inputs]), y[:, :outputs])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step


def both(first: Step, second: Step) -> Step:
    def step(batch: Batch) -> None:
        first(batch)
        second(batch)

    return step


def with_boundaries(batches: Iterator[Batch]) -> Iterator[Batch]:
    """A hand-written epoch with ddp_even's boundaries: an agreement of two int64s before the
    first batch, and each rank's counts gathered after the last (its statistics)."""
    opening = torch.zeros(2, dtype=torch.int64)
    dist.all_reduce(opening, op=dist.ReduceOp.MAX)
    handed = 0
    for batch in batches:
        handed += 1
        yield batch
    counts = torch.tensor([handed, 0, 0, 0], dtype=torch.int64)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)


def flag_before_every_step(shard: list[Batch]) -> Iterator[Batch]:
    """The hand-written way: a blocking all_reduce(MIN) of "I have a batch" before each step."""
    has_batch = torch.zeros(1, dtype=torch.int64)
    batches = iter(shard)
    while True:
        batch = next(batches, None)
        has_batch.fill_(0 if batch is None else 1)
        dist.all_reduce(has_batch, op=dist.ReduceOp.MIN)
        if batch is None or has_batch.item() == 0:
            return
        yield batch


def count_overlapped(shard: list[Batch], window: int) -> Iterator[Batch]:
    """The least a window with one batch of look-ahead can cost, truncate-style, in a few
    lines: the count of the next ``window`` batches read ahead is all-reduced (MIN, async)
    before the last batch of this window is handed out, and waited for when the next batch
    is asked for. No checks, no statistics, no error paths."""
    batches = iter(shard)

    def read_and_start() -> tuple[list[Batch], torch.Tensor, Any]:
        ahead = list(itertools.islice(batches, window))
        count = torch.full((1,), len(ahead), dtype=torch.int64)
        return ahead, count, dist.all_reduce(count, op=dist.ReduceOp.MIN, async_op=True)

    ahead, count, work = read_and_start()
    while True:
        work.wait()
        agreed = ahead[: int(count.item())]
        for index, batch in enumerate(agreed):
            if index == window - 1:
                ahead, count, work = read_and_start()
            yield batch
        if len(agreed) < window:
            return


def known_lengths(shard: list[Batch], check_every: int) -> Iterator[Batch]:
    """Known lengths by hand, truncate-style: the counts agreed once (a blocking all-reduce
    after :func:`with_boundaries`' opening one: ddp_even's first agreement goes in two forms),
    then an async all-reduce checking the sources every ``check_every`` steps and after the
    last, each waited for when the next starts, as ddp_even's checks are."""
    count = torch.tensor([len(shard)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    steps = int(count.item())
    check = torch.zeros(1, dtype=torch.int64)
    work: Any = None
    for index, batch in enumerate(shard[:steps], start=1):
        yield batch
        if index % check_every == 0 or index == steps:
            if work is not None:
                work.wait()
            work = dist.all_reduce(check, op=dist.ReduceOp.BOR, async_op=True)
    if work is not None:
        work.wait()


def shard_lengths(steps: int, world_size: int) -> list[int]:
    return [round(steps * (1 - 0.1 * rank)) for rank in range(world_size)]


def make_shard(rank: int, length: int, config: BenchConfig) -> list[Batch]:
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(config.batch_size, config.features, generator=generator),
            torch.randn(config.batch_size, config.outputs, generator=generator),
        )
        for _ in range(length)
    ]


@dataclass(frozen=True)
class Workload:
    """A step, and how torch Join runs it: Join needs a DDP model in the step."""

    name: str
    step: Step
    # The step Join runs, with a DDP model of its own: Join leaves its joinables' join
    # config enabled when it exits (torch 2.13), so a model used in Join keeps paying Join's
    # all-reduces in every later loop; no other variant may share it.
    join_model: DistributedDataParallel
    join_step: Step
    # What Join is compared with: the floor, or (without a model in the workload) the
    # workload plus the same one-parameter DDP step on equal shards.
    join_reference: Step | None = None
    # The step with a DDP model of its own that averages through ddp_even.allreduce_hook.
    hooked_step: Step | None = None


def make_workloads(step_s: float, config: BenchConfig) -> list[Workload]:
    def mlp(hook: bool = False) -> DistributedDataParallel:
        torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts them too)
        ddp_model = DistributedDataParallel(
            nn.Sequential(
                nn.Linear(config.features, 128), nn.ReLU(), nn.Linear(128, config.outputs)
            )
        )
        if hook:
            ddp_model.register_comm_hook(None, allreduce_hook)
        return ddp_model

    def one_parameter() -> DistributedDataParallel:
        torch.manual_seed(0)
        return DistributedDataParallel(nn.Linear(1, 1, bias=False))

    model, join_model, hooked_model = mlp(), mlp(), mlp(hook=True)
    tiny, join_tiny = one_parameter(), one_parameter()
    tiny_step, join_tiny_step = training_step(tiny, 1, 1), training_step(join_tiny, 1, 1)
    spinning, sleeping = busy_wait(step_s), idle_wait(step_s)
    return [
        Workload("loader", no_compute, join_tiny, join_tiny_step, tiny_step),
        Workload(
            "ddp model",
            training_step(model, config.features, config.outputs),
            join_model,
            training_step(join_model, config.features, config.outputs),
            hooked_step=training_step(hooked_model, config.features, config.outputs),
        ),
        *(
            Workload(name, wait, join_tiny, both(wait, join_tiny_step), both(wait, tiny_step))
            for name, wait in ((BUSY_WAIT, spinning), (IDLE_WAIT, sleeping))
        ),
    ]


def variants_for(workload: Workload, shard: list[Batch], equal: int, window: int) -> list[Variant]:
    """Every variant of one workload, in the order they run and are printed."""
    step = workload.step

    def even(mode: str, sync_every: int | None) -> Callable[[], Iterable[Batch]]:
        loader: EvenLoader[Batch] = EvenLoader(
            shard, mode, sync_every=sync_every, timeout=COLLECTIVE_TIMEOUT_S
        )
        return lambda: loader

    def join() -> Join:
        return Join([workload.join_model])

    variants = [Variant(FLOOR, FLOOR, lambda: shard[:equal], step)]
    join_reference = FLOOR
    if workload.join_reference is not None:
        join_reference = FLOOR_TINY_DDP
        variants.append(
            Variant(FLOOR_TINY_DDP, FLOOR_TINY_DDP, lambda: shard[:equal], workload.join_reference)
        )
    if workload.hooked_step is not None:
        variants.append(Variant(HOOKED, FLOOR, lambda: shard[:equal], workload.hooked_step))
    variants += [
        Variant(
            "hand-written blocking flag",
            FLOOR,
            lambda: with_boundaries(flag_before_every_step(shard)),
            step,
        ),
        Variant(
            OVERLAPPED + "K=1", FLOOR, lambda: with_boundaries(count_overlapped(shard, 1)), step
        ),
        Variant(
            OVERLAPPED + f"K={window}",
            FLOOR,
            lambda: with_boundaries(count_overlapped(shard, window)),
            step,
        ),
        Variant(
            HAND_KNOWN,
            FLOOR,
            lambda: with_boundaries(known_lengths(shard, check_settings.CHECK_EVERY)),
            step,
        ),
        Variant(JOIN, join_reference, lambda: shard, workload.join_step, join),
        Variant("ddp_even truncate K=1", FLOOR, even("truncate", 1), step),
        Variant(f"ddp_even truncate K={window}", FLOOR, even("truncate", window), step),
        Variant("ddp_even cycle K=1", FLOOR, even("cycle", 1), step),
        Variant(f"ddp_even cycle K={window}", FLOOR, even("cycle", window), step),
        Variant("ddp_even pad K=1", FLOOR, even("pad", 1), step),
        Variant(f"ddp_even pad K={window}", FLOOR, even("pad", window), step),
        Variant("ddp_even truncate known lengths", FLOOR, even("truncate", None), step),
        Variant("ddp_even cycle known lengths", FLOOR, even("cycle", None), step),
        Variant(
            f"ddp_even truncate known lengths {EVERY_16}",
            FLOOR,
            even("truncate", None),
            step,
            functools.partial(_check_spacing, check_settings.CHECK_EVERY),
        ),
        Variant(
            f"ddp_even truncate known lengths {ONE_CHECK}",
            FLOOR,
            even("truncate", None),
            step,
            functools.partial(_check_spacing, 1 << 30),
        ),
        Variant(LONG_ONLY, FLOOR, even("truncate", 1), step, _long_form_only),
    ]
    return variants


@contextlib.contextmanager
def _long_form_only() -> Iterator[None]:
    """Every agreement in the long form alone, one all-reduce of two int64s."""
    saved = CollectiveAgreer.start
    CollectiveAgreer.start = CollectiveAgreer._start_long  # type: ignore[method-assign]
    try:
        yield
    finally:
        CollectiveAgreer.start = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _check_spacing(steps: int) -> Iterator[None]:
    """Known lengths with the checks of the sources ``steps`` apart whatever the steps take
    (the one after the last step stays): beside the default spacing, what it saves."""
    saved = check_settings.CHECK_EVERY, check_settings.MOST_STEPS_BETWEEN_CHECKS
    check_settings.CHECK_EVERY = check_settings.MOST_STEPS_BETWEEN_CHECKS = steps
    try:
        yield
    finally:
        check_settings.CHECK_EVERY, check_settings.MOST_STEPS_BETWEEN_CHECKS = saved


def measure_on_rank(rank: int, world_size: int, config: BenchConfig) -> dict[str, Any]:
    """Everything one rank runs; rank 0's timings are the result."""
    latency_s = rank_0s(statistics.median(allreduce_times_s(config.latency_samples)))
    mean_by_elements_s = allreduce_means_by_elements_s(config.latency_samples)
    counter = CollectiveCounter()
    counter.install()
    lengths = shard_lengths(config.steps, world_size)
    shard = make_shard(rank, lengths[rank], config)
    table = {
        workload.name: variants_for(workload, shard, min(lengths), config.window)
        for workload in make_workloads(2 * latency_s, config)
    }
    load_before = os.getloadavg()
    for round_index in range(config.repeats + 1):
        for variants in table.values():
            for variant in in_turn(variants, round_index):
                dist.barrier()  # every variant starts with the ranks together
                with variant.context():
                    timing = timed_epoch(variant.batches(), variant.step, counter)
                if round_index > 0:
                    variant.timings.append(timing)
    return {
        "world_size": world_size,
        "shard_batches": lengths,
        "allreduce_latency_s": latency_s,
        "allreduce_mean_by_elements_s": mean_by_elements_s,
        "wait_step_s": 2 * latency_s,
        # This machine may be shared: 1-minute load averages before and after the rounds.
        "load_average": [load_before[0], os.getloadavg()[0]],
        "results": summarize(table),
    }


def summarize(table: dict[str, list[Variant]]) -> list[dict[str, Any]]:
    rows = []
    for workload, variants in table.items():
        per_step = {v.name: statistics.median(t.per_step_s for t in v.timings) for v in variants}
        cpu = {v.name: statistics.median(t.cpu_per_step_s for t in v.timings) for v in variants}
        for variant in variants:
            rows.append(
                {
                    "workload": workload,
                    "variant": variant.name,
                    "reference": variant.reference,
                    "steps": variant.timings[0].steps,
                    "per_step_s": per_step[variant.name],
                    "cpu_per_step_s": cpu[variant.name],
                    "added_s": per_step[variant.name] - per_step[variant.reference],
                    "added_cpu_s": cpu[variant.name] - cpu[variant.reference],
                    "collectives_per_epoch": max(t.collectives for t in variant.timings),
                    "collectives_in_loop": max(t.collectives_in_loop for t in variant.timings),
                    "rounds": [asdict(t) for t in variant.timings],
                }
            )
    return rows


def measure_world(world_size: int, config: BenchConfig) -> dict[str, Any]:
    """Start ``world_size`` ranks, run every variant on them, return rank 0's numbers."""
    result: dict[str, Any] = run_on_ranks(measure_on_rank, world_size, config)
    result["targets"] = evaluate_targets(result)
    return result


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, per workload: ``sync_every=1`` within 1.2x the CPU per step of the
    hand-written loop doing the same collectives; known lengths at most 10 us of CPU per step
    over the floor, boundaries included; a known-lengths epoch's checks where they belong."""
    rows = {(row["workload"], row["variant"]): row for row in result["results"]}
    workloads = dict.fromkeys(row["workload"] for row in result["results"])
    targets = []
    for workload in workloads:
        # Truncate's: the hand-written loop stops where the shortest shard ends, as it does.
        least = rows[(workload, f"{OVERLAPPED}K=1")]
        row = rows[(workload, "ddp_even truncate K=1")]
        ratio = row["cpu_per_step_s"] / least["cpu_per_step_s"]
        targets.append(
            {
                "target": f"{workload}: K=1 CPU per step <= 1.2x the hand-written K=1's",
                "variant": "ddp_even truncate K=1",
                "passed": ratio <= 1.2,
                "detail": f"{row['cpu_per_step_s'] * 1e6:.1f} us against "
                f"{least['cpu_per_step_s'] * 1e6:.1f} us ({ratio:.2f}x; collectives "
                f"{row['collectives_per_epoch']} against {least['collectives_per_epoch']})",
            }
        )
        one_check = rows[(workload, f"ddp_even truncate known lengths {ONE_CHECK}")]
        hand = rows[(workload, HAND_KNOWN)]
        for mode in ("truncate", "cycle"):
            row = rows[(workload, f"ddp_even {mode} known lengths")]
            targets.append(
                {
                    "target": f"{workload}: known lengths <= 10 us CPU a step, boundaries included",
                    "variant": f"ddp_even {mode} known lengths",
                    "passed": row["added_cpu_s"] <= 10e-6,
                    "detail": f"adds {row['added_cpu_s'] * 1e6:+.1f} us CPU and "
                    f"{row['added_s'] * 1e6:+.1f} us wall a step; with no check in the loop "
                    "(truncate, only the one after the last step) "
                    f"{one_check['added_cpu_s'] * 1e6:+.1f} us CPU; by hand, a check every "
                    f"{check_settings.CHECK_EVERY} steps, {hand['added_cpu_s'] * 1e6:+.1f} us CPU",
                }
            )
        for variant in ("ddp_even truncate known lengths", "ddp_even cycle known lengths"):
            row = rows[(workload, variant)]
            in_loop = row["collectives_in_loop"]
            checks = -(-row["steps"] // check_settings.CHECK_EVERY)
            targets.append(
                {
                    "target": "known lengths: no agreement between the first and last step, "
                    f"a check of the sources at most every {check_settings.CHECK_EVERY} steps "
                    "and after the last",
                    "variant": f"{variant} ({workload})",
                    "passed": 1 <= in_loop <= checks,
                    "detail": f"{in_loop} in loop, {row['collectives_per_epoch']} per epoch",
                }
            )
    return targets


def results_table(result: dict[str, Any]) -> Table:
    latency_us = result["allreduce_latency_s"] * 1e6
    table = Table(
        title=f"{result['world_size']} ranks (gloo, CPU): one all-reduce = {latency_us:.0f} us, "
        f"shards {'/'.join(map(str, result['shard_batches']))} batches",
        title_justify="left",
    )
    table.add_column("workload")
    table.add_column("variant")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    previous = None
    for row in result["results"]:
        if previous is not None and row["workload"] != previous:
            table.add_section()
        name, reference = row["variant"], row["reference"]
        if name == reference:
            added = ["reference", ""]
        else:
            added = [f"{row['added_s'] * 1e6:+.1f} us", f"{row['added_cpu_s'] * 1e6:+.1f} us"]
        table.add_row(
            row["workload"] if row["workload"] != previous else "",
            name + (f" (vs {reference})" if reference not in (FLOOR, name) else ""),
            str(row["steps"]),
            f"{row['per_step_s'] * 1e6:.1f} us",
            f"{row['cpu_per_step_s'] * 1e6:.1f} us",
            *added,
            str(row["collectives_per_epoch"]),
            str(row["collectives_in_loop"]),
        )
        previous = row["workload"]
    load = "/".join(f"{value:.1f}" for value in result["load_average"])
    table.caption = (
        f"rank 0, median over rounds; busy and idle wait = {result['wait_step_s'] * 1e6:.0f} us "
        "per step; "
        f"load average before/after: {load} on {os.cpu_count()} CPUs"
    )
    return table


def print_targets(console: Console, result: dict[str, Any]) -> None:
    for target in result["targets"]:
        verdict = {True: "[green]PASS[/]", False: "[red]FAIL[/]", None: "[yellow]N/A[/]"}[
            target["passed"]
        ]
        console.print(
            f"{verdict} {result['world_size']} ranks, {target['target']}: "
            f"{target['variant']}: {target['detail']}",
            highlight=False,
        )


@click.command()
@click.option(
    "--ranks",
    multiple=True,
    type=click.IntRange(2),
    help="World sizes to run, one table each (repeatable).  [default: 2 and 4; --quick: 2]",
)
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True)
@click.option(
    "--steps", type=click.IntRange(20), default=96, show_default=True, help="Batches on rank 0."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/agreement.json"),
    show_default=True,
)
@click.option("--quick", is_flag=True, help="Smoke run: 48 steps, 2 repeats.")
def main(ranks: tuple[int, ...], repeats: int, steps: int, out: Path, quick: bool) -> None:
    """Per-step cost of keeping uneven ranks in step: ddp_even, Join, a blocking flag."""
    config = BenchConfig(steps=48, repeats=2) if quick else BenchConfig(steps, repeats)
    ranks = ranks or ((2,) if quick else (2, 4))
    # Wide enough for the table when the output is not a terminal (a file, a pipe).
    console = Console() if sys.stdout.isatty() else Console(width=170)
    runs = []
    for world_size in ranks:
        started = time.perf_counter()
        result = measure_world(world_size, config)
        console.print(results_table(result))
        by_elements = result["allreduce_mean_by_elements_s"]
        console.print(
            f"all-reduce (MAX) of {' / '.join(by_elements)} int64s, mean of a loop of them: "
            + " / ".join(f"{seconds * 1e6:.0f}" for seconds in by_elements.values())
            + " us per call (ddp_even's short form sends 1 with all_reduce(BOR), its long form 2)"
        )
        print_targets(console, result)
        warn_if_loaded(
            console, result["load_average"][0], "differences of tens of microseconds are noise"
        )
        console.print(f"({time.perf_counter() - started:.0f} s)\n")
        runs.append(result)
    write_results(console, out, config, runs)


if __name__ == "__main__":
    main()
