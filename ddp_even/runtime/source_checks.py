"""When an epoch with known lengths checks its sources: the same steps on every rank.

With known lengths the ranks agree once per epoch; after that they only check, now and then,
that no rank's source failed or ran short (``runtime/epochs.py``). Each check is an
asynchronous all-reduce waited for when the next one starts, so it is free only when the steps
between two checks outlast it. Short steps (a small model on CPU, a loader timed alone) would
wait for it: every :data:`CHECK_EVERY` steps, a check of a few hundred microseconds is 10 % of
steps of half a millisecond.

So checks are :data:`CHECK_EVERY` steps apart, or as many more as take about
:data:`CHECK_PERIOD_S` at the pace of the steps so far, up to :data:`MOST_STEPS_BETWEEN_CHECKS`.
Every rank needs the same spacing, and paces differ between ranks: each check carries every
rank's proposal (in its report's ``available``, which a check does not otherwise use), and the
reduction gives every rank the smallest, which spaces the check after the next one. The first
two checks of a loader's first epoch are :data:`CHECK_EVERY` steps apart; a later epoch's start
at the spacing its previous epoch's last check agreed, so that an epoch shorter than a few
spacings does not wait for a check started :data:`CHECK_EVERY` short steps before. That spacing
is part of the epoch's settings, which the ranks compare before its first step: a rank with
another history (a loader made anew on it alone) fails there. A proposal is a power of two times
:data:`CHECK_EVERY`, sent as its exponent (0 to 6): a check then fits the agreement's short
form, one int64 (``agreement/wire.py``), at the price of checks up to twice as close as the
period asks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

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
