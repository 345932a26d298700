"""Full reports as fixed-size bytes, and the one error every rank raises from them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_even.agreement.wire import (
    MAX_COUNT,
    Report,
    error_from_reports,
    report_bytes,
    report_from_bytes,
)
from ddp_even.errors import (
    EmptyShardError,
    EvenLoaderError,
    OffPlanError,
    PeerSourceError,
    RankMismatchError,
)

SETTINGS = "mode=cycle steps_per_epoch=None sync_every=1"
REPORT_BYTES = 2048


def _report(rank: int, **changes: object) -> Report:
    fields: dict[str, object] = {
        "rank": rank,
        "epoch": 1,
        "fingerprint": 123456789,
        "settings": SETTINGS,
        "available": 4,
        "own_available": 4,
    }
    fields.update(changes)
    return Report(**fields)  # type: ignore[arg-type]


# --- report_bytes / report_from_bytes -------------------------------------------------------


# Every character UTF-8 can encode (all but the surrogates, category Cs): st.text()'s default
# alphabet, given without its codec, whose table Hypothesis would otherwise work out (seconds of
# CPU) in every test process of a fresh clone, before .hypothesis/ caches it.
UTF8_CHARACTERS = st.characters(exclude_categories=["Cs"])
texts = st.text(UTF8_CHARACTERS, max_size=120)
reports_st = st.builds(
    Report,
    rank=st.integers(0, 2**20),
    epoch=st.integers(0, 2**31),
    fingerprint=st.integers(0, 2**56 - 1),
    settings=texts,
    available=st.integers(0, 2**40),
    own_available=st.integers(0, 2**40),
    empty_shard=st.booleans(),
    failed=st.booleans(),
    failure=st.none() | st.tuples(texts, st.text(UTF8_CHARACTERS, max_size=400)),
    off_plan=st.none() | texts,
)


@pytest.mark.timeout(30)
@given(reports_st)
def test_a_report_comes_back_unchanged(report: Report) -> None:
    packed = report_bytes(report)
    assert packed.dtype == np.uint8
    assert packed.shape == (REPORT_BYTES,)
    assert report_from_bytes(packed) == report


def _shortened(message: str) -> str:
    report = _report(3, failed=True, failure=("OSError", message), off_plan="reads [1, 3]")
    packed = report_bytes(report)
    assert packed.shape == (REPORT_BYTES,)
    back = report_from_bytes(packed)
    assert back.failure is not None
    assert back.failure[0] == "OSError"
    # Everything else arrives whole.
    assert dataclasses.replace(back, failure=report.failure) == report
    shortened = back.failure[1]
    assert shortened.endswith("...")
    assert message.startswith(shortened[:-3])
    return shortened


@pytest.mark.timeout(30)
def test_a_very_long_failure_message_is_shortened_to_fit() -> None:
    message = "; ".join(f"row group {i} of part-{i % 7}.parquet is corrupt" for i in range(5000))
    assert len(message) > 100 * REPORT_BYTES
    # What is cut is the end of the message; most of the 2048 bytes still carry it.
    assert 1500 < len(_shortened(message)) < REPORT_BYTES


@pytest.mark.timeout(30)
def test_a_very_long_multi_line_failure_message_keeps_what_fits() -> None:
    message = "".join(f"line {i}: row group {i} is corrupt\n" for i in range(5000))
    assert 1500 < len(_shortened(message)) < REPORT_BYTES


# Long messages from a short piece repeated, then a tail (drawing 6000 characters is slow).
long_messages = st.builds(
    lambda piece, times, tail: piece * (2500 // len(piece) + times) + tail,
    st.text(UTF8_CHARACTERS, min_size=1, max_size=30),
    st.integers(0, 100),
    st.text(UTF8_CHARACTERS, max_size=100),
)


@pytest.mark.timeout(30)
@given(long_messages, texts)
def test_any_long_failure_message_still_decodes(message: str, error_type: str) -> None:
    # Quotes, backslashes, control and non-ASCII characters take several bytes in JSON.
    report = _report(0, failed=True, failure=(error_type, message))
    back = report_from_bytes(report_bytes(report))
    assert back.failure is not None
    assert back.failure[0] == error_type
    shortened = back.failure[1]
    assert shortened == message or (
        shortened.endswith("...") and message.startswith(shortened[:-3])
    )
    assert dataclasses.replace(back, failure=report.failure) == report


# --- error_from_reports ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_ranks_in_other_loops_are_a_mismatch_named_rank_by_rank() -> None:
    reports = [
        _report(0),
        _report(1, settings="mode=truncate steps_per_epoch=None sync_every=1", fingerprint=9),
        _report(2, epoch=2, failed=True, failure=("OSError", "x")),
    ]
    error = error_from_reports(reports, None, steps_done=0)
    assert type(error) is RankMismatchError
    text = str(error)
    assert f"rank 0: epoch 1, {SETTINGS}; " in text
    assert "rank 1: epoch 1, mode=truncate steps_per_epoch=None sync_every=1; " in text
    assert text.endswith(f"rank 2: epoch 2, {SETTINGS})")


@pytest.mark.timeout(30)
def test_a_count_too_large_to_carry_names_the_rank() -> None:
    reports = [
        _report(0),
        _report(5, available=MAX_COUNT + 1, own_available=3),
        _report(6, failed=True, failure=("OSError", "x")),
    ]
    error = error_from_reports(reports, None, steps_done=7)
    assert type(error) is EvenLoaderError
    assert f"rank 5: {2**32}" in str(error)
    assert "set sync_every" in str(error)
    assert "rank 0" not in str(error)


@pytest.mark.timeout(30)
def test_the_rank_whose_source_failed_raises_its_own_exception() -> None:
    own = OSError("disk gone")
    reports = [
        _report(0, off_plan="x"),
        _report(1, failed=True, failure=("OSError", "disk gone")),
        _report(2, empty_shard=True),
    ]
    assert error_from_reports(reports, own, steps_done=4) is own


@pytest.mark.timeout(30)
def test_the_others_raise_a_peer_error_naming_the_first_failed_rank() -> None:
    reports = [
        _report(3, off_plan="x"),
        _report(4, failed=True, failure=("OSError", "corrupt footer")),
        _report(5, failed=True, failure=("ValueError", "bad row")),
        _report(6, empty_shard=True),
    ]
    error = error_from_reports(reports, None, steps_done=41)
    assert type(error) is PeerSourceError
    assert (error.failed_rank, error.error_type, error.error_message, error.step) == (
        4,
        "OSError",
        "corrupt footer",
        41,
    )
    assert str(error).startswith(
        "rank 4's data source raised OSError: corrupt footer (before step 41)"
    )


@pytest.mark.timeout(30)
def test_ranks_off_their_plan_are_named() -> None:
    reports = [
        _report(0, off_plan="it reads row groups [1, 3], its shard of the plan is [2]"),
        _report(1),
        _report(
            2, off_plan="it reads row groups [0], its shard of the plan is [0, 4]", empty_shard=True
        ),
    ]
    error = error_from_reports(reports, None, steps_done=0)
    assert type(error) is OffPlanError
    assert error.off_plan == {
        0: "it reads row groups [1, 3], its shard of the plan is [2]",
        2: "it reads row groups [0], its shard of the plan is [0, 4]",
    }


@pytest.mark.timeout(30)
def test_empty_shards_are_named() -> None:
    reports = [_report(0, empty_shard=True), _report(1), _report(2, empty_shard=True)]
    error = error_from_reports(reports, None, steps_done=0)
    assert type(error) is EmptyShardError
    assert error.empty_ranks == (0, 2)
    assert "rank(s) 0, 2 have no batch" in str(error)


@pytest.mark.timeout(30)
def test_every_rank_derives_the_same_error_from_the_same_reports() -> None:
    reports = [_report(0), _report(1, failed=True, failure=("KeyError", "'x'"))]
    # Gathered reports travel as bytes; the decoded ones give the same error.
    decoded = [report_from_bytes(report_bytes(report)) for report in reports]
    errors = [error_from_reports(seen, None, steps_done=2) for seen in (reports, decoded)]
    assert {(type(error), str(error)) for error in errors} == {
        (
            PeerSourceError,
            "rank 1's data source raised KeyError: 'x' (before step 2); every rank stops here",
        )
    }
