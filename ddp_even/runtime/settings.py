"""What every rank of an epoch must agree on before its first step: the loader's settings, and
a digest of them that each agreement carries (``agreement/wire.py``'s key).

The settings are described in one line of ``name=value`` fields (a saved state keeps it), so
that a state saved with other settings is refused naming each field that differs
(:func:`differing_settings`).

**When an epoch with known lengths checks its sources** (:class:`CheckSchedule`): the same
steps on every rank, :data:`CHECK_EVERY` steps apart or as many more as take about
:data:`CHECK_PERIOD_S` at the pace of the steps so far, up to :data:`MOST_STEPS_BETWEEN_CHECKS`;
each check carries every rank's proposal for the spacing, and the smallest spaces the check
after the next (docs/design.md, "How an epoch runs": whole epoch).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddp_even.modes import Mode

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan


#: The field of a description that holds a digest: named when it differs, never shown.
ROWS_PER_RANK = "rows_per_rank"
#: The fields a loader with a shard plan has, and one without has not.
PLAN_FIELDS = ("sharding", "batch_size", ROWS_PER_RANK)

#: The fewest steps between two checks of the sources. A source that fails or runs short is
#: heard of by every rank, at the same step, at most two spacings later (the check after it
#: fails is waited for at the next one).
CHECK_EVERY = 16
#: The time the steps between two checks take at least, where :data:`CHECK_EVERY` steps take
#: less: a check (an all-reduce of a few hundred µs, docs/performance.md) then costs about 1 %
#: of the time or less.
CHECK_PERIOD_S = 0.05
#: The most steps between two checks: bounds the batches a rank whose source failed hands out
#: again before every rank hears of it.
MOST_STEPS_BETWEEN_CHECKS = 1024
#: The largest proposal a rank makes: the exponent of :data:`MOST_STEPS_BETWEEN_CHECKS`.
LARGEST_PROPOSAL = (MOST_STEPS_BETWEEN_CHECKS // CHECK_EVERY).bit_length() - 1


def differing_settings(saved: str, current: str) -> dict[str, tuple[str | None, str | None]]:
    """The fields of two :attr:`Settings.description` lines that differ, in ``saved``'s order
    then ``current``'s, with their values in each (None: that one has no such field).

    Example:
        >>> differing_settings(
        ...     "mode=pad steps_per_epoch=None sync_every=epoch sharding=rows batch_size=8",
        ...     "mode=pad steps_per_epoch=None sync_every=epoch sharding=rows batch_size=4",
        ... )
        {'batch_size': ('8', '4')}
    """
    before, now = settings_fields(saved), settings_fields(current)
    names = [*before, *(name for name in now if name not in before)]
    return {
        name: (before.get(name), now.get(name))
        for name in names
        if before.get(name) != now.get(name)
    }


def mismatched_settings(saved: str, current: str) -> dict[str, tuple[str, str] | None]:
    """Each field of two descriptions that differs, with its value there and here to show
    (None for the rows per rank: a digest, named only); a plan that only one of the two has is
    one field, ``plan``.

    Example:
        >>> mismatched_settings("mode=pad sync_every=1", "mode=pad sync_every=1 sharding=rows "
        ...                     "batch_size=4 rows_per_rank=0a1b2c3d")
        {'plan': ('(none)', '(sharding=rows batch_size=4)')}
    """
    differing = differing_settings(saved, current)
    one_plan = any(None in values for name, values in differing.items() if name in PLAN_FIELDS)
    shown: dict[str, tuple[str, str] | None] = {
        name: None if name == ROWS_PER_RANK else (there or "(none)", here or "(none)")
        for name, (there, here) in differing.items()
        if not (one_plan and name in PLAN_FIELDS)
    }
    if one_plan:
        shown = {"plan": (_plan_of(saved), _plan_of(current)), **shown}
    return shown


def _plan_of(description: str) -> str:
    fields = settings_fields(description)
    if "sharding" not in fields:
        return "(none)"
    return f"(sharding={fields['sharding']} batch_size={fields.get('batch_size')})"


def settings_fields(description: str) -> dict[str, str]:
    """The ``name=value`` fields of a :attr:`Settings.description` line."""
    # Values hold no spaces: names, numbers, None, digests.
    pairs = (word.split("=", 1) for word in description.split() if "=" in word)
    return {name: value for name, value in pairs}


@dataclass(frozen=True)
class Settings:
    """What every rank must agree on before the first step."""

    mode: Mode
    steps_per_epoch: int | None
    # Batches per agreement; None: the whole epoch (known lengths).
    sync_every: int | None
    # The loader's shard plan, when it has one: ranks agree on its sharding and every rank's
    # rows and batches.
    plan: ShardPlan | None = None
    # Known lengths: the spacing the first checks of the sources start at, as the exponent
    # the previous epoch's last check agreed (:class:`CheckSchedule`). Every rank has the same
    # after the same epochs; the agreement compares it before the first step. 0 in a loader's
    # first epoch and in a resumed one (a state may be loaded into a new loader on some ranks
    # and into a used one on others).
    check_spacing: int = 0

    @functools.cached_property
    def description(self) -> str:
        described = (
            f"mode={self.mode.name} steps_per_epoch={self.steps_per_epoch} "
            f"sync_every={self.sync_every if self.sync_every is not None else 'epoch'}"
        )
        if self.check_spacing:
            described += f" checks_every={CHECK_EVERY << self.check_spacing}"
        if self.plan is not None:
            plan = self.plan
            # Every rank's rows, digested (a list as long as the ranks): the batches per rank
            # follow from them and the batch size, which is a field of its own.
            digest = hashlib.blake2b(repr(plan.rows_per_rank).encode(), digest_size=4)
            described += (
                f" sharding={plan.sharding} batch_size={plan.batch_size} "
                f"{ROWS_PER_RANK}={digest.hexdigest()}"
            )
        return described

    @functools.cached_property
    def fingerprint(self) -> int:
        # Cached: reports are built every step, and these settings never change.
        digest = hashlib.blake2b(self.description.encode(), digest_size=7).digest()
        return int.from_bytes(digest, "big")

    def window(self, steps_done: int) -> int | None:
        """The most batches any rank offers in the next agreement."""
        remaining = None if self.steps_per_epoch is None else self.steps_per_epoch - steps_done
        if self.sync_every is None:
            return remaining
        return self.sync_every if remaining is None else min(self.sync_every, remaining)


@dataclass
class CheckSchedule:
    """The steps of one epoch at which every rank checks its sources (besides its last step).

    Example::

        >>> schedule = CheckSchedule.after(0)
        >>> schedule.next_step
        16
        >>> proposal = schedule.proposal(16)  # carried by the check started at step 16
        >>> schedule.checked(16, agreed=None)  # no check settled yet: the first spacing
        >>> schedule.next_step
        32
        >>> schedule.checked(32, agreed=3)  # the smallest proposal the check of step 16 carried
        >>> schedule.next_step  # 32 + 16 * 2**3
        160
        >>> CheckSchedule.after(0, spacing=2).next_step  # the previous epoch agreed 16 * 2**2
        64
    """

    next_step: int
    # Where the pace is measured from: the last check (or the epoch's first step).
    _from_step: int
    _from_s: float = field(default_factory=time.monotonic)
    # The exponent of the spacing until a check settles one: the previous epoch's.
    _spacing: int = 0

    @classmethod
    def after(cls, steps_done: int, spacing: int = 0) -> CheckSchedule:
        """The schedule of an epoch that starts (or resumes) after ``steps_done`` steps, its
        first checks ``CHECK_EVERY * 2**spacing`` steps apart (``spacing``: what the previous
        epoch's last check agreed); the first falls on a multiple of that, as in an
        uninterrupted run."""
        every = CHECK_EVERY << spacing
        return cls(
            next_step=(steps_done // every + 1) * every, _from_step=steps_done, _spacing=spacing
        )

    def proposal(self, step: int) -> int:
        """This rank's spacing for a later check, as the exponent ``e`` of ``CHECK_EVERY *
        2**e`` steps: the most such steps that take at most :data:`CHECK_PERIOD_S` at the pace
        since the last check, within the bounds."""
        now = time.monotonic()
        elapsed_s = now - self._from_s
        steps = step - self._from_step
        self._from_step, self._from_s = step, now
        wanted = MOST_STEPS_BETWEEN_CHECKS
        if elapsed_s > 0:
            wanted = min(math.ceil(CHECK_PERIOD_S * steps / elapsed_s), wanted)
        return max(wanted // CHECK_EVERY, 1).bit_length() - 1

    def checked(self, step: int, agreed: int | None) -> None:
        """Schedule the next check after the one started at ``step``: ``CHECK_EVERY *
        2**agreed`` steps on, ``agreed`` being the exponent the check settled at ``step``
        carried (every rank's smallest proposal), or the epoch's first spacing when none was
        settled."""
        self.next_step = step + (CHECK_EVERY << (self._spacing if agreed is None else agreed))
