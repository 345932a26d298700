"""How many of ddp_even's files rank 0 enters from making a loader to holding its first batch.

Run it with ``python -m benchmarks.first_batch_files`` (both paths) or ``--path factory`` /
``--path from_parquet``. Two gloo ranks are spawned (``benchmarks/ranks.py``); each writes
nothing, reads a small Parquet dataset written beforehand, and on rank 0 the count is taken:

* the paths: README's loop, ``EvenLoader(one_pass, mode="cycle")`` with ``one_pass`` returning
  ``BatchedDataLoader(make_batch_reader(...))`` sharded by rank (the ``factory`` path, needs
  petastorm), and ``EvenLoader.from_parquet(path, batch_size=64, mode="cycle")``;
* what counts: every ``call`` event that ``sys.setprofile`` (and ``threading.setprofile``, for
  the threads ddp_even starts) reports whose code object's file is under ``ddp_even/``, from
  just before ``ddp_even.EvenLoader`` is first looked up (so importing ``ddp_even.loader`` and
  every module it pulls in counts: a module's import runs its code) until ``next()`` on the
  first epoch has returned the first batch. ``import ddp_even`` itself (its ``__init__.py``
  and ``errors.py``) and the user's own imports (torch, petastorm) come before and do not
  count; each file counts once however many of its functions run.

It prints, per path, the files entered (relative to the package) and their number.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import click

from benchmarks.ranks import run_on_ranks

PATHS = ("factory", "from_parquet")
_ROW_GROUPS = [300, 40, 200, 120, 60, 20]


def _write_dataset(directory: Path) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sum(_ROW_GROUPS)
    table = pa.table({"x": np.arange(rows, dtype=np.float32), "y": np.ones(rows, dtype=np.float32)})
    with pq.ParquetWriter(directory / "part-0.parquet", table.schema) as writer:
        start = 0
        for size in _ROW_GROUPS:
            writer.write_table(table.slice(start, size))
            start += size
    return directory.as_uri()


def _files_entered(rank: int, world_size: int, path: str, url: str) -> list[str]:
    import ddp_even

    if path == "factory":
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader

        def one_pass() -> Any:
            reader = make_batch_reader(url, num_epochs=1, cur_shard=rank, shard_count=world_size)
            return BatchedDataLoader(reader, batch_size=64)

    package = str(Path(ddp_even.__file__).parent) + "/"
    entered: set[str] = set()

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(package):
                entered.add(filename[len(package) :])

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        if path == "factory":
            loader = ddp_even.EvenLoader(one_pass, mode="cycle")
        else:
            loader = ddp_even.EvenLoader.from_parquet(url, batch_size=64, mode="cycle")
        epoch = iter(loader)
        next(epoch)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    epoch.close()  # type: ignore[attr-defined]
    return sorted(entered)


@click.command()
@click.option("--path", "paths", type=click.Choice(PATHS), multiple=True, help="[default: both]")
def main(paths: tuple[str, ...]) -> None:
    """Files of ddp_even that rank 0 of 2 enters up to the first batch, per path."""
    with tempfile.TemporaryDirectory(prefix="first-batch-") as directory:
        url = _write_dataset(Path(directory))
        for path in paths or PATHS:
            files = run_on_ranks(_files_entered, 2, path, url)
            print(f"{path}: {len(files)} files of ddp_even entered up to the first batch")
            for name in files:
                print(f"  {name}")


if __name__ == "__main__":
    main()
