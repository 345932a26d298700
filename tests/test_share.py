"""Share mode on several gloo ranks: every rank takes ceil(B / W) steps, every batch is handed
out exactly once (the ranks that ran out train on the others' batches), padding only at the
last step, weights that make that step's mean right, exact statistics, DDP replicas equal; an
epoch read only to ``len(loader)`` batches, as a trainer that knows it reads, is complete.

What each rank hands out is checked against the batches' ids (every id of every shard once over
all ranks), not against ddp_even's arithmetic. Sources: lists of mixed batches (tensors, numpy
arrays, strings, nested), and petastorm's own loader sharded by row group on 4 ranks.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from ddp_even import EvenLoader, PeerSourceError
from ddp_even.runtime.settings import CHECK_EVERY
from ddp_even.share_plan import handed_out_in
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.spawn import RankError, run_ranks

pytestmark = pytest.mark.multirank

ROWS_PER_BATCH = 3


def _shard(rank: int, counts: list[int]) -> list[dict[str, Any]]:
    """Rank ``rank``'s batches: ids numbered over all shards, in several kinds of leaf."""
    first = sum(counts[:rank])
    batches = []
    for index in range(first, first + counts[rank]):
        ids = torch.arange(index * ROWS_PER_BATCH, (index + 1) * ROWS_PER_BATCH)
        batches.append(
            {
                "id": ids,
                "features": {"x": ids.float().unsqueeze(1).repeat(1, 4) / 100},
                "label": ids.numpy().astype(np.float32),
                "name": f"batch {index}",
            }
        )
    return batches


def _train(rank: int, world_size: int, counts: list[int], sync_every: int | None) -> Any:
    """Two epochs of a DDP model over this rank's shard in share mode; per step what it saw."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    from tests.helpers.scenarios import control_collectives_issued

    loader = EvenLoader(_shard(rank, counts), mode="share", sync_every=sync_every, timeout=60)
    epochs = []
    for _ in range(2):
        seen = []
        collectives_before = control_collectives_issued()
        for batch in loader:
            assert isinstance(batch["label"], np.ndarray) and batch["label"].dtype == np.float32
            assert batch["name"] == f"batch {int(batch['id'][0]) // ROWS_PER_BATCH}"
            optimizer.zero_grad()
            prediction = model(batch["features"]["x"]).squeeze(1)
            loss = torch.nn.functional.mse_loss(prediction, torch.from_numpy(batch["label"]))
            (loss * loader.batch_weight).backward()
            optimizer.step()
            seen.append((batch["id"].tolist(), loader.padding, loader.batch_weight))
        epochs.append(
            (seen, loader.stats.as_dict(), control_collectives_issued() - collectives_before)
        )
    return epochs, [parameter.detach().clone() for parameter in model.parameters()]


def _check_epoch(
    counts: list[int], seen_per_rank: list[list[tuple[list[int], bool, float]]]
) -> None:
    world_size, total = len(counts), sum(counts)
    steps = math.ceil(total / world_size)
    assert [len(seen) for seen in seen_per_rank] == [steps] * world_size
    real = Counter(
        row for seen in seen_per_rank for ids, padding, _ in seen if not padding for row in ids
    )
    assert real == Counter(range(total * ROWS_PER_BATCH)), "every row exactly once"
    padded = [step for seen in seen_per_rank for step, (_, pad, _) in enumerate(seen) if pad]
    assert padded == [steps - 1] * (world_size * steps - total), "padding at the last step only"
    for seen in seen_per_rank:
        for step, (_, padding, weight) in enumerate(seen):
            if padding:
                assert weight == 0.0
            elif step == steps - 1:
                assert weight == pytest.approx(world_size / (world_size - len(padded)))
            else:
                assert weight == 1.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("counts", "sync_every"),
    [([3, 17], None), ([0, 9, 2, 14], 3), ([1, 0, 0], None)],
    ids=["3/17 on 2", "an empty rank, 4 ranks, windows of 3", "fewer batches than ranks"],
)
def test_every_batch_once_in_equal_steps(counts: list[int], sync_every: int | None) -> None:
    results = run_ranks(_train, len(counts), counts, sync_every, timeout=200)
    world_size, total = len(counts), sum(counts)
    for epoch in range(2):
        seen = [epochs[epoch][0] for epochs, _ in results]
        _check_epoch(counts, seen)
        stats = results[0][0][epoch][1]
        assert all(epochs[epoch][1] == stats for epochs, _ in results), "the same everywhere"
        assert stats["mode"] == "share" and stats["epoch"] == epoch
        steps = math.ceil(total / world_size)
        for rank in range(world_size):
            own, sent = stats["own_batches"][rank], stats["sent_batches"][rank]
            assert own + sent == counts[rank], "a rank's shard is its own batches and those sent"
            assert own + stats["received_batches"][rank] + stats["padded_batches"][rank] == steps
            assert stats["sent_rows"][rank] == sent * ROWS_PER_BATCH
            assert stats["received_rows"][rank] == stats["received_batches"][rank] * 3
        assert sum(stats["sent_batches"]) == sum(stats["received_batches"])
        # What an elastic resume takes as read before each step: what was handed out then.
        shards = [_shard(rank, counts) for rank in range(world_size)]
        for step in range(steps + 1):
            handed = handed_out_in(counts, sync_every or 1, step, ends_known=sync_every is None)
            expected = sorted(
                int(shards[r][i]["id"][0]) for r in range(world_size) for i in handed[r]
            )
            real = sorted(
                ids[0] for rank_seen in seen for ids, pad, _ in rank_seen[:step] if not pad
            )
            assert real == expected, step
        # One agreement a window, no sum beside it: per rank at most one sum of the counts and
        # one window of no steps (where its shard ended), the opening agreement's long form and
        # the statistics' gather.
        windows = math.ceil(steps / (sync_every or 1))
        most = windows + 2 * world_size + 2
        if sync_every is None:
            # Known lengths, the hand-over planned before the first step: the opening
            # agreement's long form, the sum of the counts, a check every CHECK_EVERY steps
            # and at the last, the statistics' gather.
            most = 2 + 1 + (steps // CHECK_EVERY + 1) + 1
        assert all(epochs[epoch][2] <= most for epochs, _ in results), (most, results)
    first, *others = [final for _, final in results]
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True)), "DDP diverged"


# Row groups of 40, 30, 1, 17, 3, 5, 6, ... (one file per list): petastorm's round robin gives
# the ranks shards of very different sizes.
UNEVEN_ROW_GROUPS = [[40, 3], [30, 5], [1, 6, 4, 2], [17]]


def _assert_every_row_once(batches_per_rank: list[list[list[int]]]) -> None:
    """Every row of UNEVEN_ROW_GROUPS in exactly one batch handed out (not as padding)."""
    rows = sorted(row for batches in batches_per_rank for batch in batches for row in batch)
    assert rows == list(range(sum(map(sum, UNEVEN_ROW_GROUPS))))


def _petastorm_rows(rank: int, world_size: int, url: str) -> list[list[int]]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    def batches() -> BatchedDataLoader:
        reader = make_batch_reader(
            url, num_epochs=1, cur_shard=rank, shard_count=world_size, workers_count=2
        )
        return BatchedDataLoader(reader, batch_size=8)

    loader = EvenLoader(batches, mode="share", timeout=60)
    ids = [batch["id"].tolist() for batch in loader if not loader.padding]
    assert loader.stats.steps[rank] == max(loader.stats.steps)
    return [ids, list(loader.stats.steps)]


@pytest.mark.petastorm
@pytest.mark.timeout(240)
def test_petastorm_sharded_by_row_group_on_4_ranks(tmp_path: Any) -> None:
    url = write_plain_dataset(tmp_path / "data", UNEVEN_ROW_GROUPS)
    results = run_ranks(_petastorm_rows, 4, url, timeout=200)
    _assert_every_row_once([ids for ids, _ in results])
    steps = {tuple(result[1]) for result in results}
    assert len(steps) == 1 and len(set(steps.pop())) == 1


class _CorruptAfterFour(torch.utils.data.Dataset[list[int]]):
    """Rank 0's six batches, the fifth of which cannot be read."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> list[int]:
        if index == 4:
            raise OSError("corrupt row group after 4 batches")
        return [index]


def _failing(rank: int, world_size: int, length_known: bool) -> Any:
    def batches() -> Any:
        for index in range(6 if rank == 0 else 2):
            if rank == 0 and index == 4:
                raise OSError("corrupt row group after 4 batches")
            yield [index]

    # A map-style DataLoader has a length: the hand-over is planned before the first step.
    source: Any = batches
    if length_known:
        dataset = _CorruptAfterFour() if rank == 0 else [[0], [1]]
        source = torch.utils.data.DataLoader(dataset, batch_size=None)
    loader = EvenLoader(source, mode="share", timeout=30)
    return len(list(loader))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length_known", [False, True], ids=["agreed as it goes", "planned"])
def test_a_failing_source_is_the_same_error_on_every_rank(length_known: bool) -> None:
    outcomes = run_ranks(_failing, 2, length_known, timeout=100, capture_exceptions=True)
    assert isinstance(outcomes[0], RankError) and "corrupt row group" in outcomes[0].message
    assert isinstance(outcomes[1], RankError) and outcomes[1].type_name == PeerSourceError.__name__
    assert "rank 0" in outcomes[1].message


def _resumed(
    rank: int, world_size: int, counts: list[int], stop: int, sync_every: int | None
) -> Any:
    """The whole epoch, and the same epoch stopped after ``stop`` steps and resumed from the
    loader state saved there (in the middle of a hand-over)."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))

    def make() -> EvenLoader[Any]:
        return EvenLoader(_shard(rank, counts), mode="share", sync_every=sync_every, timeout=60)

    def ids(loader: Any, start: int) -> list[tuple[list[int], bool]]:
        seen = []
        for step, batch in enumerate(loader, start=start):
            model(batch["features"]["x"]).sum().backward()
            seen.append((batch["id"].tolist(), loader.padding_at(step)))
        return seen

    whole = make()
    expected = ids(whole, 0)
    stopped = make()
    epoch = iter(stopped)
    for _ in range(stop):
        model(next(epoch)["features"]["x"]).sum().backward()
    state = stopped.state_dict()
    del epoch
    resumed = make()
    resumed.load_state_dict(state)
    got = ids(resumed, stop)
    return expected[stop:], got, whole.stats.as_dict(), resumed.stats.as_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync_every", [3, None], ids=["windows of 3", "planned"])
def test_a_resume_cut_in_the_middle_of_a_hand_over_is_the_uninterrupted_epoch(
    sync_every: int | None,
) -> None:
    # Rank 0's 2 batches end at step 2; from there rank 1 hands it one of its batches a step
    # (in windows of 3: steps 2 to 4 in the second); the cut falls after step 3, between two.
    counts, stop = [2, 11], 3
    outcomes = run_ranks(_resumed, 2, counts, stop, sync_every, timeout=200)
    for expected, got, whole, resumed in outcomes:
        assert got == expected
        assert resumed.pop("resumed_at_step") == stop and whole.pop("resumed_at_step") is None
        assert resumed == whole
        assert whole["received_batches"][0] > 0


def _from_parquet(rank: int, world_size: int, url: str) -> Any:
    loader = EvenLoader.from_parquet(url, 4, mode="share", timeout=60)
    ids = [batch["id"].tolist() for batch in loader if not loader.padding]
    return ids, loader.stats.as_dict()


@pytest.mark.timeout(240)
def test_from_parquet_round_robin_every_row_once_and_nothing_called_lost(tmp_path: Any) -> None:
    url = write_plain_dataset(tmp_path / "data", UNEVEN_ROW_GROUPS)
    results = run_ranks(_from_parquet, 3, url, timeout=200)
    _assert_every_row_once([ids for ids, _ in results])
    stats = results[0][1]
    assert any(stats["sent_batches"]), "round robin leaves the shards uneven"
    # A shard's batches sent to other ranks are read, not lost or dropped, against its plan.
    assert stats["lost_rows"] == (0, 0, 0) and stats["dropped_rows"] == (0, 0, 0)
    batches = sum(stats["own_batches"]) + sum(stats["sent_batches"])
    assert stats["steps"] == (math.ceil(batches / 3),) * 3


def _to_its_length(rank: int, world_size: int, url: str) -> Any:
    """Two epochs read as a trainer that knows ``len(loader)`` reads them (Lightning): that
    many batches, then the next ``iter()``, which closes the epoch before."""
    loader = EvenLoader.from_parquet(url, 3, mode="share", timeout=60)
    rows = []
    for _ in range(2):
        epoch = iter(loader)
        rows.append([row for _ in range(len(loader)) for row in next(epoch)["id"].tolist()])
    del epoch
    return rows, [stats.as_dict() for stats in loader.history]


@pytest.mark.timeout(240)
def test_an_epoch_read_to_its_length_is_complete(tmp_path: Any) -> None:
    # Shards of 9 and 5 batches: rank 0 reads its last batch without finding its shard's end,
    # so the window after the last step's is planned with no steps.
    url = write_plain_dataset(tmp_path / "data", [[14, 8, 12, 6]])
    results = run_ranks(_to_its_length, 2, url, timeout=200)
    for epoch in range(2):
        assert sorted(row for rows, _ in results for row in rows[epoch]) == list(range(40))
    for _, history in results:
        assert [stats["epoch"] for stats in history] == [0, 1]
        assert [stats["steps"] for stats in history] == [(7, 7)] * 2
        assert history == results[0][1]
