"""Pad mode on 4 gloo ranks over uneven shards: every real row exactly once, padding exactly
where a rank's data ends, exact statistics, exact metrics and gradients, and collectives of the
training's own inside the loop.

Petastorm's source kinds run in one process group: lists, petastorm's loaders (footer-known
lengths, and agreeing every step); ``from_parquet`` in every sharding, and a balanced plan with
an empty rank, in another (they need no petastorm). What each rank
must hand out is checked against the dataset's ids, not against ddp_even's arithmetic; the
metrics and gradients against one process computing them over the same rows.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed_functional

from ddp_even import EvenLoader
from tests.helpers.datasets import write_plain_dataset, write_unischema_dataset
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank

WORLD_SIZE = 4
BATCH_SIZE = 8
# 108 rows in 9 row groups; petastorm's round robin gives the 4 ranks 58, 9, 34 and 7 rows:
# 8, 2, 5 and 1 batches of 8, the last of each short.
SIZES = [[40, 3], [30, 5], [1, 6, 4, 2], [17]]
TOTAL_ROWS = 108
# 3 row groups over 4 ranks: the balanced plan leaves one rank without rows.
FEW_SIZES = [[20, 7, 12]]
SHARDINGS = ("round_robin", "row_groups", "rows", "replicate")
# A list source: rank r's rows are the ids in [CUTS[r], CUTS[r + 1]), in batches of 7.
CUTS = (0, 50, 60, 100, TOTAL_ROWS)
LIST_BATCH = 7


@dataclass(frozen=True)
class Data:
    plain: str
    few: str
    # make_reader's dataset: written where petastorm is installed.
    unischema: str | None = None


@dataclass
class Seen:
    """What one rank handed out in one epoch: per step its ids, padding flag and weight."""

    ids: list[list[int]] = field(default_factory=list)
    padding: list[bool] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    length: int | None = None


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("pad")
    return Data(
        plain=write_plain_dataset(root / "plain", SIZES),
        few=write_plain_dataset(root / "few", FEW_SIZES),
    )


def _list_shard(url: str, rank: int) -> list[dict[str, torch.Tensor]]:
    table = pq.read_table(url.removeprefix("file://"), columns=["id", "value"])
    ids = torch.from_numpy(table.column("id").to_numpy())
    values = torch.from_numpy(table.column("value").to_numpy())
    start, stop = CUTS[rank], CUTS[rank + 1]
    return [
        {
            "id": ids[at : min(at + LIST_BATCH, stop)],
            "value": values[at : min(at + LIST_BATCH, stop)],
        }
        for at in range(start, stop, LIST_BATCH)
    ]


def _loader(source: str, data: Data, rank: int) -> EvenLoader[Any]:
    if source == "list":
        return EvenLoader(_list_shard(data.plain, rank), mode="pad")
    if source.startswith("batched"):
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader

        def batches() -> BatchedDataLoader:
            reader = make_batch_reader(
                data.plain, num_epochs=1, cur_shard=rank, shard_count=WORLD_SIZE, workers_count=2
            )
            return BatchedDataLoader(reader, batch_size=BATCH_SIZE)

        # Footer-known lengths (a plan worked out from the footers), or agreeing every step.
        return EvenLoader(
            batches, mode="pad", sync_every=1 if source.endswith("every step") else None
        )
    if source == "rows of make_reader":
        from petastorm import make_reader
        from petastorm.pytorch import DataLoader

        assert data.unischema is not None

        def rows() -> DataLoader:
            reader = make_reader(
                data.unischema,
                num_epochs=1,
                cur_shard=rank,
                shard_count=WORLD_SIZE,
                workers_count=2,
            )
            return DataLoader(reader, batch_size=BATCH_SIZE)

        return EvenLoader(rows, mode="pad")
    _, sharding = source.removesuffix(" with an empty rank").split(" ")
    url = data.few if source.endswith("empty rank") else data.plain
    return EvenLoader.from_parquet(
        url,
        BATCH_SIZE,
        mode="pad",
        sharding=sharding,  # type: ignore[arg-type]
    )


PETASTORM_SOURCES = ["list", "batched", "batched, every step", "rows of make_reader"]
ARROW_SOURCES = [
    *(f"from_parquet {sharding}" for sharding in SHARDINGS),
    "from_parquet row_groups with an empty rank",
]
SOURCES = [
    *(pytest.param(source, marks=pytest.mark.petastorm) for source in PETASTORM_SOURCES),
    *ARROW_SOURCES,
]


def _hand_out(
    rank: int, world_size: int, data: Data, sources: Sequence[str]
) -> dict[str, list[Seen]]:
    """Worker: two epochs of every source; each step takes part in a DDP all-reduce."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    seen: dict[str, list[Seen]] = {}
    for source in sources:
        loader = _loader(source, data, rank)
        epochs = []
        for _ in range(2):
            epoch = Seen()
            for batch in loader:
                weight = loader.batch_weight
                values = batch["value"].float().reshape(-1, 1)
                (model(values).pow(2).mean() * weight).backward()
                epoch.ids.append([int(row_id) for row_id in batch["id"]])
                epoch.padding.append(loader.padding)
                epoch.weights.append(weight)
            epoch.stats = loader.stats.as_dict()
            epochs.append(epoch)
        with contextlib.suppress(TypeError):  # no plan: the steps are agreed as they go
            epochs[-1].length = len(loader)
        seen[source] = epochs
    return seen


@pytest.fixture(scope="module")
def handed_out_by_petastorm(
    data: Data, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, list[Seen]]]:
    unischema = write_unischema_dataset(tmp_path_factory.mktemp("pad") / "unischema", SIZES)
    with_unischema = Data(plain=data.plain, few=data.few, unischema=unischema)
    return run_ranks(_hand_out, WORLD_SIZE, with_unischema, PETASTORM_SOURCES, timeout=400)


@pytest.fixture(scope="module")
def handed_out_by_arrow(data: Data) -> list[dict[str, list[Seen]]]:
    return run_ranks(_hand_out, WORLD_SIZE, data, ARROW_SOURCES, timeout=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("source", SOURCES)
def test_every_real_row_once_and_padding_exactly_where_data_ends(
    request: pytest.FixtureRequest, source: str
) -> None:
    reader = "arrow" if source in ARROW_SOURCES else "petastorm"
    handed_out: list[dict[str, list[Seen]]] = request.getfixturevalue(f"handed_out_by_{reader}")
    dataset_rows = 39 if source.endswith("empty rank") else TOTAL_ROWS
    for epoch in range(2):
        ranks = [per_rank[source][epoch] for per_rank in handed_out]
        steps = {len(seen.ids) for seen in ranks}
        assert len(steps) == 1, f"unequal steps {steps}"
        (step_count,) = steps
        own = [seen.padding.count(False) for seen in ranks]
        assert step_count == max(own)
        real: Counter[int] = Counter()
        for rank, seen in enumerate(ranks):
            # Padding is a suffix: from the step where the rank's data ran out, to the end.
            assert seen.padding == [False] * own[rank] + [True] * (step_count - own[rank])
            real.update(row for ids in seen.ids[: own[rank]] for row in ids)
            if source.endswith("replicate"):
                assert Counter(row for ids in seen.ids[: own[rank]] for row in ids) == Counter(
                    range(dataset_rows)
                ), "replicate: every rank reads every row once"
            # A padding batch is the rank's last batch again, or (no batch of its own) the
            # first batch of the lowest rank that has one.
            donor = next(peer for peer, count in enumerate(own) if count)
            copied = seen.ids[own[rank] - 1] if own[rank] else ranks[donor].ids[0]
            assert all(ids == copied for ids in seen.ids[own[rank] :])
        if not source.endswith("replicate"):
            assert real == Counter(range(dataset_rows)), "every real row exactly once"
        if source.endswith("empty rank"):
            assert own.count(0) == 1
        _check_weights(ranks)
        _check_stats(ranks, own, epoch)
    # Lengths known up front: a plan, given or worked out from the footers.
    planned = source not in ("list", "batched, every step")
    last = handed_out[0][source][-1]
    assert last.length == (len(last.ids) if planned else None)


def _check_weights(ranks: list[Seen]) -> None:
    """``n * world_size / N``: n the batch's real rows, N the step's over all ranks."""
    for step in range(len(ranks[0].ids)):
        real = [0 if seen.padding[step] else len(seen.ids[step]) for seen in ranks]
        for rank, seen in enumerate(ranks):
            expected = real[rank] * WORLD_SIZE / sum(real)
            assert seen.weights[step] == pytest.approx(expected), (step, rank)


def _check_stats(ranks: list[Seen], own: list[int], epoch: int) -> None:
    stats = ranks[0].stats
    assert all(seen.stats == stats for seen in ranks), "the same statistics on every rank"
    steps = len(ranks[0].ids)
    assert stats["epoch"] == epoch and stats["mode"] == "pad"
    assert stats["steps"] == (steps,) * WORLD_SIZE
    assert stats["own_batches"] == tuple(own)
    assert stats["repeated_batches"] == (0,) * WORLD_SIZE
    assert stats["padded_batches"] == tuple(steps - count for count in own)
    padded_rows = tuple(
        sum(len(ids) for ids in seen.ids[count:]) for seen, count in zip(ranks, own, strict=True)
    )
    assert stats["padded_rows"] == padded_rows
    assert stats["samples"] == tuple(sum(map(len, seen.ids)) for seen in ranks)
    assert stats["truncated"] == (False,) * WORLD_SIZE
    assert stats["passes"] == (1,) * WORLD_SIZE
    assert stats["oversampling"] == 0.0


# --- metrics: exact, also with a collective of the loop's own at every step -------------------


def _predictions(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A fixed model of the rows: a regression of the label, and a class for each row."""
    values, labels = batch["value"].double(), batch["label"]
    return 0.02 * values + 0.3, labels.double(), batch["id"] ** 2 % 3, labels


def _metrics() -> tuple[Any, Any]:
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.regression import MeanSquaredError

    return MeanSquaredError().set_dtype(torch.float64), MulticlassAccuracy(
        num_classes=3, average="micro"
    )


def _evaluate(rank: int, world_size: int, url: str) -> dict[str, float]:
    """Worker: the metrics over this rank's shard in pad mode, two ways."""
    from torchmetrics.regression import MeanSquaredError

    plain = EvenLoader.from_parquet(url, BATCH_SIZE, mode="pad")
    mse, accuracy = _metrics()
    for batch in plain:
        regression, target, classes, labels = _predictions(batch)
        if not plain.padding:
            mse.update(regression, target)
            accuracy.update(classes, labels)
    # A collective of the loop's own at every step: a running all-reduce, and a metric synced at
    # every step, which every rank must call, padding ranks with no rows.
    per_step = EvenLoader.from_parquet(url, BATCH_SIZE, mode="pad", sync_every=1)
    synced = MeanSquaredError(dist_sync_on_step=True).set_dtype(torch.float64)
    squared_error = torch.zeros(2, dtype=torch.float64)
    for batch in per_step:
        regression, target, _, _ = _predictions(batch)
        real = slice(0) if per_step.padding else slice(None)
        synced(regression[real], target[real])
        step_sums = torch.stack(
            [((regression[real] - target[real]) ** 2).sum(), torch.tensor(float(len(target[real])))]
        )
        dist.all_reduce(step_sums)
        squared_error += step_sums
    return {
        "mse": float(mse.compute()),
        "accuracy": float(accuracy.compute()),
        "synced mse": float(synced.compute()),
        "running mse": float(squared_error[0] / squared_error[1]),
        "rows": float(squared_error[1]),
    }


@pytest.mark.petastorm
@pytest.mark.timeout(300)
def test_torchmetrics_under_pad_equal_one_process_over_the_whole_dataset(data: Data) -> None:
    results = run_ranks(_evaluate, WORLD_SIZE, data.plain, timeout=250)
    table = pq.read_table(data.plain.removeprefix("file://"))
    whole = {name: torch.from_numpy(table.column(name).to_numpy()) for name in table.column_names}
    regression, target, classes, labels = _predictions(whole)
    mse, accuracy = _metrics()
    expected = {"mse": float(mse(regression, target)), "accuracy": float(accuracy(classes, labels))}
    assert 0.1 < expected["accuracy"] < 0.9  # a metric that would notice a row missing or twice
    for result in results:
        assert result["rows"] == TOTAL_ROWS
        assert result["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)
        for name in ("mse", "synced mse", "running mse"):
            assert result[name] == pytest.approx(expected["mse"], rel=1e-12), name


# --- training: a batch norm over every rank's rows, and the weighted loss's gradient ----------


class CrossRankBatchNorm(torch.nn.Module):
    """Batch normalisation over the rows of every rank at the step, as ``torch.nn.SyncBatchNorm``
    computes it (torch 2.13 runs that on GPUs only: ``aten::batch_norm_stats`` has no CPU
    kernel). The statistics are all-reduced in the forward pass and their gradients in the
    backward pass (``torch.distributed.nn``'s differentiable all-reduce): every rank must enter
    both collectives at every step, as with SyncBatchNorm."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(features, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(features, dtype=torch.float64))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        count = torch.ones_like(rows[:, :1]).sum(0)
        sums = torch.cat([count, rows.sum(0), (rows * rows).sum(0)])
        if dist.is_initialized():
            sums = distributed_functional.all_reduce(sums)
        features = rows.shape[1]
        mean = sums[1 : 1 + features] / sums[0]
        variance = sums[1 + features :] / sums[0] - mean * mean
        return (rows - mean) / torch.sqrt(variance + 1e-5) * self.weight + self.bias


def _model(norm: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(1, 6)]
    layers += [CrossRankBatchNorm(6)] if norm else []
    layers += [torch.nn.Tanh(), torch.nn.Linear(6, 1)]
    return torch.nn.Sequential(*layers).double()


def _features(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["value"].double().reshape(-1, 1) / 50, batch["label"].double().reshape(-1, 1)


def _train(rank: int, world_size: int, url: str, norm: bool) -> dict[str, Any]:
    """Worker: per step, the DDP gradient at the initial weights (lr 0: every step's gradient
    is taken at the same weights) and this rank's real rows; then two epochs of training."""
    model = torch.nn.parallel.DistributedDataParallel(_model(norm))
    loader = EvenLoader.from_parquet(url, BATCH_SIZE, mode="pad")
    gradients, rows = [], []
    for batch in loader:
        features, labels = _features(batch)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features), labels)
        (loss * loader.batch_weight).backward()
        gradients.append([parameter.grad.clone() for parameter in model.parameters()])
        rows.append(None if loader.padding else (features, labels))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = EvenLoader.from_parquet(url, BATCH_SIZE, mode="pad", sync_every=2)
    for _ in range(2):
        for batch in windows:
            features, labels = _features(batch)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(features), labels)
            (loss * windows.batch_weight).backward()
            optimizer.step()
    return {
        "gradients": gradients,
        "rows": rows,
        "weights": [parameter.detach().clone() for parameter in model.parameters()],
        "steps": windows.stats.steps,
    }


def _one_process_gradient(norm: bool, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    model = _model(norm)
    features = torch.cat([features for features, _ in rows])
    labels = torch.cat([labels for _, labels in rows])
    torch.nn.functional.mse_loss(model(features), labels).backward()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.petastorm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("norm", [False, True], ids=["mlp", "batch norm over the ranks"])
def test_training_takes_the_gradient_of_the_mean_loss_over_the_real_rows(
    data: Data, norm: bool
) -> None:
    results = run_ranks(_train, WORLD_SIZE, data.plain, norm, timeout=250)
    # No hang with collectives in every forward and backward; the replicas stayed equal.
    assert {result["steps"] for result in results} == {(8,) * WORLD_SIZE}
    for result in results[1:]:
        assert all(
            torch.equal(a, b) for a, b in zip(result["weights"], results[0]["weights"], strict=True)
        )
    checked = 0
    for step, gradient in enumerate(results[0]["gradients"]):
        real = [result["rows"][step] for result in results if result["rows"][step] is not None]
        padded = len(real) < WORLD_SIZE
        if norm and padded:
            # The batch statistics at a padded step include the padding rows (their weight
            # takes them out of the loss, not out of the statistics): not the real rows' own.
            continue
        expected = _one_process_gradient(norm, real)
        for got, want in zip(gradient, expected, strict=True):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), (step, got, want)
        checked += 1
    # Steps 0 and 1 have ranks with short batches (7 rows at step 0, 1 row at step 1); from
    # step 1 on some ranks pad.
    assert checked == (1 if norm else 8)
    assert math.isfinite(float(results[0]["weights"][0].sum()))


# --- failures: agreed on every rank, padding meanwhile ------------------------------------------


class _FailsAt(Sequence[list[int]]):
    """A rank's shard of known length (as a map-style DataLoader) whose batch ``at`` raises."""

    def __init__(self, rank: int, length: int, at: int | None) -> None:
        self.batches = [[rank * 100 + index] for index in range(length)]
        self.at = at

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: Any) -> Any:
        if index == self.at:
            raise OSError(f"corrupt row group after {index} batches")
        return self.batches[index]


def _fail(rank: int, world_size: int) -> dict[str, Any]:
    """Worker: a planned pad epoch whose rank 1 fails after 3 batches; then an empty shard whose
    donor's first batch cannot be sent (a generator cannot be saved)."""
    from ddp_even import EvenLoaderError, PeerSourceError
    from ddp_even.planning import plan_shards

    outcome: dict[str, Any] = {}
    plan = plan_shards([8] * world_size, world_size, batch_size=1)
    loader = EvenLoader(_FailsAt(rank, 8, 3 if rank == 1 else None), mode="pad", plan=plan)
    seen = []
    try:
        for batch in loader:
            seen.append((batch, loader.padding, loader.batch_weight))
    except (OSError, PeerSourceError) as error:
        outcome["failure"] = (type(error).__name__, str(error), seen)
    unsendable = [[(row for row in range(3))]] if rank == 0 else []
    try:
        list(EvenLoader(unsendable, mode="pad"))
    except EvenLoaderError as error:
        outcome["empty"] = (type(error).__name__, str(error))
    return outcome


@pytest.mark.timeout(200)
def test_failures_are_raised_on_every_rank_and_the_failing_rank_pads_meanwhile() -> None:
    results = run_ranks(_fail, 3, timeout=150)
    for rank, result in enumerate(results):
        error, message, seen = result["failure"]
        # With a plan the ranks only check their sources every 16 steps and after the last: the
        # failing rank hands out padding (weight 0) until that check, where every rank raises.
        if rank == 1:
            assert (error, message) == ("OSError", "corrupt row group after 3 batches")
            assert seen == [([100 + i], False, 1.0) for i in range(3)] + [([102], True, 0.0)] * 5
        else:
            assert error == "PeerSourceError" and "rank 1" in message
            # The weights follow the plan (a row per rank and step) until every rank raises.
            assert seen == [([rank * 100 + i], False, 1.0) for i in range(8)]
        assert result["empty"][0] == "EmptyShardError"
        assert "rank(s) 1, 2 have no batch" in result["empty"][1]
        assert "rank 0's first batch cannot be sent" in result["empty"][1]
