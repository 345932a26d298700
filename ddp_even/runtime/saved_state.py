"""The loader's saved state: what it holds, and the checks before resuming from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What the ``format`` key of every loader state says.
STATE_FORMAT = "ddp_even.EvenLoader"
# Raised when what the state holds, or what it means, changes.
_VERSION = 1


def saved_state(
    *,
    settings: str,
    world_size: int,
    rank: int,
    epoch: int,
    step: int,
    resumed_from_world_size: int | None = None,
) -> dict[str, Any]:
    """The state :meth:`ddp_even.EvenLoader.state_dict` returns: plain ints and strings.

    ``resumed_from_world_size`` is set while an epoch that resumed on another number of ranks
    runs: its steps count the re-planned rest of the epoch, not the epoch.
    """
    return {
        "format": STATE_FORMAT,
        "version": _VERSION,
        "library_version": _library_version(),
        "settings": settings,
        "world_size": world_size,
        "rank": rank,
        "epoch": epoch,
        "step": step,
        "resumed_from_world_size": resumed_from_world_size,
    }


def resume_point(state: Mapping[str, Any], *, settings: str, world_size: int) -> tuple[int, int]:
    """``(epoch, step)`` to resume after; ``ValueError`` saying why ``state`` cannot be used."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError("not an EvenLoader state: pass what EvenLoader.state_dict() returned")
    if state.get("version") != _VERSION:
        raise ValueError(
            f"the loader state has format version {state.get('version')!r} (saved by "
            f"ddp_even {state.get('library_version')}); this ddp_even ({_library_version()}) "
            f"reads version {_VERSION}: resume with the release that saved it, or start the "
            "epoch again"
        )
    if state.get("settings") != settings:
        raise ValueError(
            f"the loader state was saved by a loader with other settings "
            f"({state.get('settings')}) than this one ({settings}): build the EvenLoader as it "
            "was built when the state was saved"
        )
    if state.get("world_size") != world_size:
        raise ValueError(
            f"the loader state was saved on {state.get('world_size')} ranks, and this job has "
            f"{world_size}: resuming mid-epoch on another number of ranks is not supported; "
            "start the next epoch with loader.set_epoch(epoch + 1)"
        )
    epoch, step = state.get("epoch"), state.get("step")
    for name, value in (("epoch", epoch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the loader state's {name} must be an int >= 0, got {value!r}")
    assert isinstance(epoch, int) and isinstance(step, int)
    if step > 0 and state.get("resumed_from_world_size") is not None:
        raise ValueError(
            f"the loader state was saved at step {step} of epoch {epoch}, which had itself "
            f"resumed from {state.get('resumed_from_world_size')} ranks on {world_size}: its "
            "steps count a re-planned rest of the epoch. Resume from the state saved before "
            f"that resume, or start the next epoch (loader.set_epoch({epoch + 1}))"
        )
    return epoch, step


def _library_version() -> str:
    from ddp_even import __version__

    return __version__
