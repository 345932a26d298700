"""What every rank of an epoch must agree on before its first step: the loader's settings, and
a digest of them that each agreement carries (``agreement/wire.py``'s key)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_even.modes import Mode
from ddp_even.runtime.source_checks import CHECK_EVERY

if TYPE_CHECKING:
    from ddp_even.planning.plans import ShardPlan


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
            identity = (plan.sharding, plan.rows_per_rank, plan.batches_per_rank, plan.batch_size)
            digest = hashlib.blake2b(repr(identity).encode(), digest_size=4)
            described += f" plan={digest.hexdigest()}"
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
