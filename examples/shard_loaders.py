"""The ways the trainer examples build an EvenLoader over a rank's shard (``--source``).

* ``factory``: ``EvenLoader(one_pass)``, where ``one_pass`` makes a fresh petastorm
  ``BatchedDataLoader(make_batch_reader(..., cur_shard=rank, shard_count=world_size))``: the
  loop a petastorm user already has, wrapped;
* ``parquet``: ``EvenLoader.from_parquet(...)``: shards planned from the Parquet footers
  (``len(loader)`` known before the first step, the statistics exact), read by pyarrow alone,
  which needs neither petastorm nor its numpy < 2 and pyarrow < 15.

petastorm is imported only by ``factory``, so ``parquet`` runs where petastorm is not
installed; there it is the default.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import click
import torch
from skewed_parquet import FEATURES, LABEL

from ddp_even import EvenLoader

SOURCES = ("factory", "parquet")
PETASTORM_INSTALLED = importlib.util.find_spec("petastorm") is not None
DEFAULT_SOURCE = "factory" if PETASTORM_INSTALLED else "parquet"

source_option = click.option(
    "--source",
    "sources",
    type=click.Choice(SOURCES),
    multiple=True,
    default=[DEFAULT_SOURCE],
    show_default=True,
    help="factory: EvenLoader(lambda: BatchedDataLoader(make_batch_reader(...))); "
    "parquet: EvenLoader.from_parquet(...), planned from the footers and read by pyarrow "
    "(no petastorm needed). Repeat to train with each.",
)


def refuse_without_petastorm(sources: Sequence[str], *others: str) -> None:
    """One line (click's ``Error: ...``) when ``sources`` or the options ``others`` read with
    petastorm and it is not installed, rather than an ImportError on every rank mid-job."""
    needing = [f"--source {source}" for source in sources if source != "parquet"] + list(others)
    if needing and not PETASTORM_INSTALLED:
        raise click.UsageError(
            f"{', '.join(needing)} {'needs' if len(needing) == 1 else 'need'} petastorm, which "
            "is not installed here: install the petastorm extra (numpy < 2, pyarrow < 15); "
            "--source parquet needs only pyarrow"
        )


def petastorm_pass(data_url: str, rank: int, world_size: int, batch_size: int) -> Callable[[], Any]:
    """A factory of fresh petastorm loaders, one per pass over this rank's round-robin shard."""
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    def one_pass() -> BatchedDataLoader:
        reader = make_batch_reader(
            data_url,
            num_epochs=1,
            cur_shard=rank,
            shard_count=world_size,
            schema_fields=[*FEATURES, LABEL],
            workers_count=2,
        )
        return BatchedDataLoader(reader, batch_size=batch_size)

    return one_pass


def even_loader(
    source: str,
    data_url: str,
    rank: int,
    world_size: int,
    *,
    batch_size: int,
    mode: str,
    joinables: Sequence[Any] = (),
) -> EvenLoader[dict[str, torch.Tensor]]:
    """This rank's EvenLoader over the dataset, built the way ``source`` says."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    if source == "factory":
        one_pass = petastorm_pass(data_url, rank, world_size, batch_size)
        return EvenLoader(one_pass, mode=mode, joinables=joinables)
    return EvenLoader.from_parquet(
        data_url,
        batch_size=batch_size,
        mode=mode,
        reader_kwargs={"schema_fields": [*FEATURES, LABEL]},
        joinables=joinables,
    )
