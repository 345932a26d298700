"""The agreement's two forms decode to the right agreement: the bitwise OR of the short form's
int64s, the elementwise maximum of the long form's pairs.

Gloo's ``all_reduce(BOR)`` and ``all_reduce(MAX)`` are exactly these over the ranks' tensors, so
taking them here over encoded reports is what the ranks receive. The settings are real
``Settings`` fingerprints (every mode, windows, ``steps_per_epoch``), the epochs small, as in
training.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddp_even.agreement.wire import (
    SHORT_MOST,
    Agreement,
    Report,
    agree_alone,
    decode,
    decode_short,
    encode,
    encode_short,
    error_from_reports,
    key_of,
    short_key_of,
)
from ddp_even.errors import EvenLoaderError
from ddp_even.modes import MODES
from ddp_even.runtime.settings import Settings

SETTINGS = [
    Settings(mode, steps_per_epoch, sync_every)
    for mode, steps_per_epoch, sync_every in itertools.product(
        MODES.values(), (None, 1, 7, 1000), (None, 1, 2, 16)
    )
]
EPOCHS = range(6)


def test_settings_and_epochs_used_here_have_distinct_keys() -> None:
    # Otherwise a mismatch below could go unseen by construction, not by a bug. (The short
    # form's 14-bit keys do collide among these; its test expects what they say.)
    pairs = [(settings.fingerprint, epoch) for settings in SETTINGS for epoch in EPOCHS]
    keys = {key_of(Report(0, epoch, fingerprint, "", 0, 0)) for fingerprint, epoch in pairs}
    assert len(keys) == len(pairs)


@st.composite
def reports(draw: st.DrawFn, rank: int, shared: tuple[Settings, int]) -> Report:
    settings, epoch = shared
    if draw(st.integers(0, 9)) == 0:  # now and then a rank in another loop
        settings, epoch = draw(st.sampled_from(SETTINGS)), draw(st.sampled_from(EPOCHS))
    available = draw(st.integers(0, 2**32 - 1) | st.integers(0, 20))
    if draw(st.integers(0, 2)) > 0:  # mostly what the short form carries
        available = draw(st.integers(0, SHORT_MOST))
    return Report(
        rank=rank,
        epoch=epoch,
        fingerprint=settings.fingerprint,
        settings=settings.description,
        available=available,
        own_available=draw(st.integers(0, available)),
        empty_shard=draw(st.integers(0, 15)) == 0,
        failed=draw(st.integers(0, 15)) == 0,
        long_form=draw(st.integers(0, 7)) == 0,
    )


@st.composite
def one_agreement(draw: st.DrawFn) -> list[Report]:
    shared = (draw(st.sampled_from(SETTINGS)), draw(st.sampled_from(EPOCHS)))
    world_size = draw(st.integers(1, 8))
    return [draw(reports(rank, shared)) for rank in range(world_size)]


def _expect(ranks: list[Report], agreement: Agreement, short: bool = False) -> None:
    keys = {short_key_of(report) if short else key_of(report) for report in ranks}
    in_the_same_loop = len(keys) == 1
    problem = any(report.failed or report.empty_shard for report in ranks)
    assert agreement.has_problem == (problem or not in_the_same_loop)
    if not agreement.has_problem:
        assert agreement.min_available == min(report.available for report in ranks)
        assert agreement.max_own_available == max(report.own_available for report in ranks)


def _long_form(ranks: list[Report]) -> Agreement:
    reduced = torch.stack([torch.from_numpy(encode(report)) for report in ranks]).amax(dim=0)
    return decode(reduced.tolist())


@given(one_agreement())
def test_the_maximum_of_encoded_reports_decodes_to_the_agreement(ranks: list[Report]) -> None:
    _expect(ranks, _long_form(ranks))


@given(one_agreement())
def test_the_or_of_short_forms_decodes_to_the_agreement_or_asks_for_the_long_form(
    ranks: list[Report],
) -> None:
    words = [encode_short(report) for report in ranks]
    assert all(0 <= word < 2**63 for word in words)  # an int64 without its sign bit
    reduced = torch.tensor(words, dtype=torch.int64)
    combined = 0
    for word in reduced.tolist():
        combined |= word
    agreement = decode_short(combined)
    needs_long = any(
        report.long_form or max(report.available, report.own_available) > SHORT_MOST
        for report in ranks
    )
    if needs_long:
        assert agreement is None
        _expect(ranks, _long_form(ranks))  # what every rank then reads from the long form
    else:
        assert agreement is not None
        _expect(ranks, agreement, short=True)


@given(one_agreement())
def test_a_single_rank_agrees_with_itself_in_either_form(ranks: list[Report]) -> None:
    _expect(ranks[:1], agree_alone(ranks[0]))


def test_a_count_the_agreement_cannot_carry_is_a_problem_for_every_rank() -> None:
    # Not raised on the one rank (the others would wait for it): carried as a problem, so
    # every rank gathers the reports and raises the same advice.
    fingerprint = SETTINGS[0].fingerprint
    too_many = Report(3, 0, fingerprint, "", 2**32, 0)
    fine = Report(0, 0, fingerprint, "", 5, 5)
    reduced = torch.stack([torch.from_numpy(encode(r)) for r in (fine, too_many)]).amax(dim=0)
    assert decode(reduced.tolist()).has_problem
    error = error_from_reports([fine, too_many], None, steps_done=0)
    assert isinstance(error, EvenLoaderError)
    with pytest.raises(EvenLoaderError, match=r"rank 3: 4294967296.*set sync_every"):
        raise error
