"""The agreement's two forms among real gloo ranks (``agreement/wire.py``, ``transport.py``).

A rank whose report needs the long form starts it at once; a rank that sent the short form
learns of it from the short form's result and joins it when it waits. Both then read the same
agreement, and the collectives after it pair as before.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank


def _agree(rank: int, world_size: int, reports: list[list[dict[str, Any]]]) -> list[Any]:
    from ddp_even.agreement.transport import CollectiveAgreer, control_group_for
    from ddp_even.agreement.wire import Report
    from tests.helpers.collectives import AllReduceCounter

    agreer = CollectiveAgreer(control_group_for(None, 30.0), 30.0)
    counter = AllReduceCounter()
    counter.start()
    heard = []
    try:
        for fields in reports:
            pending = agreer.start(Report(rank=rank, settings="s", **fields[rank]))
            if rank == 1:
                time.sleep(0.2)  # joins the long form well after rank 0 waits in it
            agreement = pending.wait()
            heard.append(
                (agreement.min_available, agreement.max_own_available, agreement.has_problem)
            )
    finally:
        counter.stop()
    return [heard, counter.calls]


def _fields(epoch: int, available: int, own: int, long_form: bool = False) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "fingerprint": 7,
        "available": available,
        "own_available": own,
        "long_form": long_form,
    }


@pytest.mark.timeout(90)
def test_a_rank_that_sent_the_short_form_joins_the_long_one_another_rank_needs() -> None:
    reports = [
        # Rank 0 cannot fit 40 batches in the short form; rank 1 could fit its 3.
        [_fields(0, 40, 40), _fields(0, 3, 3)],
        # Both short: one all-reduce each, paired as usual after the mixed one.
        [_fields(0, 5, 1), _fields(0, 2, 2)],
        # Rank 0 opens epoch 1 (long form) while rank 1 is still in epoch 0 (short form).
        [_fields(1, 4, 4, long_form=True), _fields(0, 4, 4)],
    ]
    results = run_ranks(_agree, 2, reports, timeout=60)
    for heard, all_reduces in results:
        assert heard == [(3, 40, False), (2, 2, False), (4, 4, True)]
        assert all_reduces == 2 + 1 + 2


def _mismatched_worker(
    rank: int, world_size: int, settings: list[tuple[str, int | None]]
) -> dict[str, Any]:
    from ddp_even import EvenLoader, RankMismatchError

    mode, sync_every = settings[rank]
    batches = [[rank, step] for step in range(40)]
    loader: EvenLoader[list[int]] = EvenLoader(batches, mode, sync_every=sync_every, timeout=20)
    began = time.monotonic()
    seen = 0
    try:
        for _ in loader:
            seen += 1
    except RankMismatchError as error:
        return {
            "error": "RankMismatchError",
            "message": str(error),
            "seen": seen,
            "seconds": time.monotonic() - began,
        }
    return {"error": None, "seen": seen}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "settings",
    [
        [("truncate", 1), ("truncate", None)],  # windows (short form) against known lengths
        [("truncate", 4), ("cycle", 4)],  # both in windows of the short form
        [("truncate", 32), ("truncate", 1)],  # windows of the long form against the short
    ],
    ids=["window-against-known-lengths", "other-mode", "long-windows-against-short"],
)
def test_ranks_with_other_settings_raise_the_same_error_before_the_first_step(
    settings: list[tuple[str, int | None]],
) -> None:
    # Every epoch opens with the long form: its full key meets the other rank's there.
    results = run_ranks(_mismatched_worker, 2, settings, timeout=90)
    for result in results:
        assert result["error"] == "RankMismatchError", result
        assert "not running the same loop" in result["message"]
        assert result["seen"] == 0 and result["seconds"] < 10, result
