"""The agreement's two packed int64s: their elementwise maximum decodes to the right agreement.

Gloo's ``all_reduce(MAX)`` is an elementwise maximum over the ranks' vectors, so taking it
here over encoded reports is exactly what the ranks receive. The settings are real
``Settings`` fingerprints (every mode, windows, ``steps_per_epoch``), the epochs small, as in
training.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddp_even.agreement.wire import Report, decode, encode, error_from_reports, key_of
from ddp_even.errors import EvenLoaderError
from ddp_even.modes import MODES
from ddp_even.runtime.epochs import Settings

SETTINGS = [
    Settings(mode, steps_per_epoch, sync_every)
    for mode, steps_per_epoch, sync_every in itertools.product(
        MODES.values(), (None, 1, 7, 1000), (None, 1, 2, 16)
    )
]
EPOCHS = range(6)


def test_settings_and_epochs_used_here_have_distinct_keys() -> None:
    # Otherwise a mismatch below could go unseen by construction, not by a bug.
    pairs = [(settings.fingerprint, epoch) for settings in SETTINGS for epoch in EPOCHS]
    keys = {key_of(Report(0, epoch, fingerprint, "", 0, 0)) for fingerprint, epoch in pairs}
    assert len(keys) == len(pairs)


@st.composite
def reports(draw: st.DrawFn, rank: int, shared: tuple[Settings, int]) -> Report:
    settings, epoch = shared
    if draw(st.integers(0, 9)) == 0:  # now and then a rank in another loop
        settings, epoch = draw(st.sampled_from(SETTINGS)), draw(st.sampled_from(EPOCHS))
    available = draw(st.integers(0, 2**32 - 1) | st.integers(0, 20))
    return Report(
        rank=rank,
        epoch=epoch,
        fingerprint=settings.fingerprint,
        settings=settings.description,
        available=available,
        own_available=draw(st.integers(0, available)),
        empty_shard=draw(st.integers(0, 15)) == 0,
        failed=draw(st.integers(0, 15)) == 0,
    )


@st.composite
def one_agreement(draw: st.DrawFn) -> list[Report]:
    shared = (draw(st.sampled_from(SETTINGS)), draw(st.sampled_from(EPOCHS)))
    world_size = draw(st.integers(1, 8))
    return [draw(reports(rank, shared)) for rank in range(world_size)]


@given(one_agreement())
def test_the_maximum_of_encoded_reports_decodes_to_the_agreement(ranks: list[Report]) -> None:
    reduced = torch.stack([torch.from_numpy(encode(report)) for report in ranks]).amax(dim=0)
    agreement = decode(reduced.tolist())

    in_the_same_loop = len({(report.epoch, report.fingerprint) for report in ranks}) == 1
    problem = any(report.failed or report.empty_shard for report in ranks)
    assert agreement.has_problem == (problem or not in_the_same_loop)
    if not agreement.has_problem:
        assert agreement.min_available == min(report.available for report in ranks)
        assert agreement.max_own_available == max(report.own_available for report in ranks)


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
