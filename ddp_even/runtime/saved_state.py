"""The loader's saved state: what it holds, and the checks before resuming from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What the ``format`` key of every loader state says.
STATE_FORMAT = "ddp_even.EvenLoader"
# Raised when what the state holds, or what it means, changes.
_VERSION = 1


def saved_state(
    *, settings: str, world_size: int, rank: int, epoch: int, step: int
) -> dict[str, Any]:
    """The state :meth:`ddp_even.EvenLoader.state_dict` returns: plain ints and strings."""
    return {
        "format": STATE_FORMAT,
        "version": _VERSION,
        "library_version": _library_version(),
        "settings": settings,
        "world_size": world_size,
        "rank": rank,
        "epoch": epoch,
        "step": step,
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
    return epoch, step


def _library_version() -> str:
    from ddp_even import __version__

    return __version__
