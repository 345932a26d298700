"""Batches handed from one rank to another (``ddp_even/runtime/handover.py``), on real gloo ranks.

Every kind of batch a loader yields arrives exactly as it was sent (values, types, dtypes,
shapes, a tensor sent twice arriving once): several from one sender in order, two senders to
one receiver, one sender to two receivers. A batch that cannot go raises on both ends. A sender
killed while its receiver waits, a receiver killed before it receives, and a third rank killed
while one waits for a live peer are named dead by every rank left waiting, within the loader's
``timeout`` + 5 s, with ddp_even's error and not gloo's; a live peer slower than the timeout is
waited for.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.spawn import RankError, run_ranks

pytestmark = pytest.mark.multirank

TIMEOUT = 2.0

Pair = namedtuple("Pair", ["features", "label"])


@dataclasses.dataclass
class Record:
    ids: list[int]
    image: torch.Tensor


def batches(seed: int) -> list[Any]:
    """Every kind of batch, each with ``seed`` in its values: the same on every rank."""
    base = torch.arange(100, dtype=torch.float32) + seed
    shared = torch.full((3,), seed)
    read_only = np.arange(6, dtype=np.int32).reshape(2, 3) + seed
    read_only.flags.writeable = False
    return [
        {
            "int64": torch.arange(6).reshape(2, 3) + seed,
            "bool": torch.tensor([True, False, seed % 2 == 0]),
            "bfloat16": torch.linspace(0, 1, 5, dtype=torch.bfloat16) + seed,
            "float16": torch.ones(2, 2, dtype=torch.float16) * seed,
            "uint8": torch.arange(4, dtype=torch.uint8) + seed,
            "transposed": (torch.arange(12).reshape(3, 4) + seed).t(),
            "view": base[10:20],
            "strided": base[::7],
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(seed + 0.5),
            "complex": torch.tensor([1 + 2j, seed * 1j], dtype=torch.complex64),
        },
        (
            Pair(torch.randn(4, 2, generator=torch.Generator().manual_seed(seed)), seed),
            [
                np.linspace(0, 1, 4) + seed,
                np.arange(10, dtype=np.uint16)[::3] + seed,
                np.array([True, False]),
                np.array(seed, dtype=np.int64),
                np.zeros((0, 2), dtype=np.float32),
                read_only,
                np.array(["a", "bc", str(seed)]),
                np.float32(seed),
            ],
        ),
        # No tensor at all, and a header longer than a batch's first message.
        {
            "ids": [seed, seed + 1],
            "paths": [f"part-{seed}-{index}.parquet" for index in range(200)],
            "nothing": None,
            "weight": 1.5,
        },
        (shared, shared, OrderedDict(first=seed, second=shared)),
        Record([seed], torch.full((2, 2), seed, dtype=torch.int16)),
    ]


def assert_same(got: Any, sent: Any, where: str = "batch") -> None:
    assert type(got) is type(sent), (where, type(got), type(sent))
    if isinstance(sent, torch.Tensor):
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), where
        assert torch.equal(got, sent), (where, got, sent)
    elif isinstance(sent, np.ndarray):
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), where
        assert np.array_equal(got, sent), (where, got, sent)
    elif isinstance(sent, dict):
        assert list(got) == list(sent), where
        for key in sent:
            assert_same(got[key], sent[key], f"{where}[{key!r}]")
    elif isinstance(sent, (tuple, list)):
        assert len(got) == len(sent), where
        for index, (mine, theirs) in enumerate(zip(got, sent, strict=True)):
            assert_same(mine, theirs, f"{where}[{index}]")
    elif dataclasses.is_dataclass(sent):
        assert_same(dataclasses.astuple(got), dataclasses.astuple(sent), where)
    else:
        assert got == sent, (where, got, sent)


def _receive(handover: Any, from_rank: int) -> Any:
    """The next batch ``from_rank`` sent to this rank (FIFO per pair of ranks)."""
    return handover.collect(handover.expect(from_rank, 1)[0])


def _hand_over(rank: int, world_size: int, plan: list[tuple[int, int, int]]) -> int:
    """Each ``(sender, receiver, seed)`` of ``plan``: the sender sends ``batches(seed)``, the
    receiver receives them (in the plan's order) and checks each; the number checked."""
    from ddp_even.agreement.transport import agreer_for
    from ddp_even.runtime.handover import Handover

    handover = Handover(agreer_for(None, 30.0))
    for sender, receiver, seed in plan:
        if sender == rank:
            for batch in batches(seed):
                handover.send(batch, receiver)
    checked = 0
    for sender, receiver, seed in plan:
        if receiver == rank:
            for index, sent in enumerate(batches(seed)):
                got = _receive(handover, sender)
                assert_same(got, sent, f"batch {index} of seed {seed} from rank {sender}")
                if index == 3:
                    assert got[0] is got[1] is got[2]["second"], "a tensor sent thrice is one"
                checked += 1
    handover.finish()
    return checked


@pytest.mark.timeout(120)
def test_every_kind_of_batch_arrives_as_sent_in_order_on_two_ranks() -> None:
    # Several batches one way, then the other way on the same pair.
    plan = [(0, 1, 1), (0, 1, 2), (1, 0, 3)]
    assert run_ranks(_hand_over, 2, plan, timeout=100) == [5, 10]


@pytest.mark.timeout(120)
def test_two_senders_to_one_receiver_and_one_sender_to_two_on_three_ranks() -> None:
    # Rank 2 takes rank 1's batches before rank 0's, though rank 0 sent first.
    plan = [(1, 2, 1), (0, 2, 2), (0, 1, 3), (0, 2, 4)]
    assert run_ranks(_hand_over, 3, plan, timeout=100) == [0, 5, 15]


def _unsendable(rank: int, world_size: int) -> str:
    """Rank 0 sends a batch that does not pickle, then one that does: rank 1 is told of the
    first (it waits for no batch that will not come) and gets the second."""
    from ddp_even import EvenLoaderError
    from ddp_even.agreement.transport import agreer_for
    from ddp_even.runtime.handover import Handover

    handover = Handover(agreer_for(None, 30.0))
    if rank == 0:
        with pytest.raises(TypeError, match="generator"):
            handover.send({"x": torch.ones(2), "rows": (row for row in range(3))}, 1)
        handover.send({"x": torch.ones(2)}, 1)
        handover.finish()
        return "sent"
    with pytest.raises(EvenLoaderError, match="rank 0 could not hand a batch over to rank 1"):
        _receive(handover, 0)
    assert_same(_receive(handover, 0), {"x": torch.ones(2)})
    return "told, then received"


@pytest.mark.timeout(120)
def test_a_batch_that_does_not_pickle_raises_on_its_sender_and_its_receiver() -> None:
    assert run_ranks(_unsendable, 2, timeout=100) == ["sent", "told, then received"]


def _one_dies(rank: int, world_size: int, victim: int) -> dict[str, Any]:
    """Rank 0 sends a batch to rank 1 and waits until it is received; rank 1 waits for it;
    ``victim`` dies 0.5 s after the ranks meet, before sending or receiving."""
    from ddp_even import PeerTimeoutError
    from ddp_even.agreement.transport import agreer_for
    from ddp_even.runtime.handover import Handover

    handover = Handover(agreer_for(None, TIMEOUT))
    began = time.time()
    if rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if rank == 0:
            handover.send(batches(1)[0], 1)
            handover.finish()
        else:
            _receive(handover, 0)
    except PeerTimeoutError as error:
        return {
            "missing": error.missing_ranks,
            "states": error.states,
            "after": time.time() - began,
            "message": str(error),
        }
    return {"missing": None}


def _a_third_dies(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 waits for a batch from rank 0, which waits for one from rank 2, which dies: rank 1's
    own connections stay open, so it learns of the death from the heartbeats or the verdict."""
    from ddp_even import PeerTimeoutError
    from ddp_even.agreement.transport import agreer_for
    from ddp_even.runtime.handover import Handover

    handover = Handover(agreer_for(None, TIMEOUT))
    began = time.time()
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _receive(handover, 2 if rank == 0 else 0)
    except PeerTimeoutError as error:
        after = time.time() - began
        return {"missing": error.missing_ranks, "states": error.states, "after": after}
    return {"missing": None}


def _one_pauses(rank: int, world_size: int) -> list[int]:
    """Rank 1, alive, takes longer than the timeout to receive, then to send back: rank 0 waits
    for it in finish(), then in receive()."""
    from ddp_even.agreement.transport import agreer_for
    from ddp_even.runtime.handover import Handover

    handover = Handover(agreer_for(None, TIMEOUT))
    if rank == 0:
        handover.send([rank], 1)
        handover.finish()
        back: list[int] = _receive(handover, 1)
        return back
    time.sleep(1.5 * TIMEOUT)
    got: list[int] = _receive(handover, 0)
    time.sleep(1.5 * TIMEOUT)
    handover.send([*got, rank], 0)
    handover.finish()
    return got


# timing: these tests bound how soon a fault is named, and wait past the timeout
# (pyproject.toml's markers).
@pytest.mark.timeout(120)
@pytest.mark.timing
@pytest.mark.parametrize("victim", [0, 1], ids=["sender", "receiver"])
def test_a_killed_peer_is_named_dead_by_the_rank_left_waiting(victim: int) -> None:
    survivor = 1 - victim
    results = run_ranks(_one_dies, 2, victim, timeout=100, capture_exceptions=True)
    died = f"rank {victim} died (signal SIGKILL) without a result"
    assert results[victim] == RankError("ProcessExited", died)
    named = results[survivor]
    assert isinstance(named, dict), named  # ddp_even's error, not gloo's RuntimeError
    assert named["missing"] == (victim,), named
    assert named["states"] == {victim: "dead"}, named
    assert "hand-over of a batch" in named["message"], named
    assert named["after"] <= 0.5 + TIMEOUT + 5, named


@pytest.mark.timeout(120)
@pytest.mark.timing
def test_a_rank_waiting_for_a_live_peer_names_a_third_that_died() -> None:
    results = run_ranks(_a_third_dies, 3, timeout=100, capture_exceptions=True)
    for named in results[:2]:
        assert isinstance(named, dict), named
        assert (named["missing"], named["states"]) == ((2,), {2: "dead"}), named
        assert named["after"] <= 0.5 + TIMEOUT + 5, named


@pytest.mark.timeout(120)
@pytest.mark.timing
def test_a_live_peer_slower_than_the_timeout_is_waited_for() -> None:
    assert run_ranks(_one_pauses, 2, timeout=100) == [[0, 1], [0]]
