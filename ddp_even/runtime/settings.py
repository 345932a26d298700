"""What every rank of an epoch must agree on before its first step: the loader's settings, and
a digest of them that each agreement carries (``agreement/wire.py``'s key).

The settings are described in one line of ``name=value`` fields (a saved state keeps it), so
that a state saved with other settings is refused naming each field that differs
(:func:`differing_settings`)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_even.modes import Mode
from ddp_even.runtime.source_checks import CHECK_EVERY

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan


#: The field of a description that holds a digest: named when it differs, never shown.
ROWS_PER_RANK = "rows_per_rank"
#: The fields a loader with a shard plan has, and one without has not.
PLAN_FIELDS = ("sharding", "batch_size", ROWS_PER_RANK)


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
    # the previous epoch's last check agreed (``source_checks.py``). Every rank has the same
    # after the same epochs; the agreement compares it before the first step. 0 in a loader's
    # first epoch and in a resumed one (a state may be loaded into a new loader on some ranks
    # and into a used one on others).
    check_spacing: int = 0

    @property
    def sharding(self) -> str | None:
        """How the plan cut the shards, or None without a plan."""
        return None if self.plan is None else self.plan.sharding

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
