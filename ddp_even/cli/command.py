"""``ddp-even plan``: how a dataset's shards and each mode's epoch come out before training,
from Parquet metadata only (each option's help says what it does; :mod:`ddp_even.cli.tables`
prints the result).

Only click is imported before a command runs: ``--help``, ``--version`` and usage errors answer
at once, and the planner (numpy, pyarrow, rich; never torch) is imported by the command.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any, get_args

import click

from ddp_even.errors import DatasetError
from ddp_even.names import Sharding

__all__ = ["main"]

_FORMATS = ("table", "markdown", "json")
# Beyond this many ranks (or split row groups) tables show a summary unless --all-ranks.
_MAX_LISTED = 32


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version("ddp_even"), "--version", "-V", prog_name="ddp-even")
def main() -> None:
    """ddp_even: equal steps on every DDP rank over uneven Petastorm/Parquet shards.

    \b
    Example:
      ddp-even plan file:///data/train --world-size 8 --batch-size 256
    """


@main.command("plan")
@click.argument("dataset", nargs=-1, required=True)
@click.option(
    "--world-size", "-w", type=click.IntRange(min=1), required=True, help="Number of DDP ranks."
)
@click.option(
    "--batch-size", "-b", type=click.IntRange(min=1), required=True, help="Rows per batch."
)
@click.option(
    "--sharding",
    type=click.Choice(get_args(Sharding)),
    default="round_robin",
    show_default=True,
    help="Who reads what: petastorm's round robin, whole balanced row groups, equal row "
    "ranges (rows), or every row group on every rank (replicate).",
)
@click.option("--balanced", is_flag=True, help="Deprecated: the same as --sharding row_groups.")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(_FORMATS),
    default="table",
    show_default=True,
    help="Tables for people, Markdown (a report, a pull request), or JSON for scripts.",
)
@click.option("--json", "as_json", is_flag=True, help="Short for --format json.")
@click.option("--all-ranks", is_flag=True, help=f"List every rank even beyond {_MAX_LISTED}.")
@click.option(
    "--storage-option",
    "storage_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="A storage option for a remote dataset (repeatable): endpoint_url=http://host:9000, "
    "key=..., client_kwargs.region_name=eu-west-1, anon=true. VALUE is read as JSON when it "
    "is JSON (numbers, true/false), else as text.",
)
def plan_command(
    dataset: tuple[str, ...],
    world_size: int,
    batch_size: int,
    sharding: Sharding,
    balanced: bool,
    output_format: str,
    as_json: bool,
    all_ranks: bool,
    storage_option: tuple[str, ...],
) -> None:
    """Show each rank's rows and batches and each mode's epoch for DATASET.

    DATASET is a URL (file://, s3://, gs://, hdfs://, abfs://, ...) or a path to a dataset
    directory or Parquet file, or several Parquet files (read in the order given, as petastorm
    does). Only metadata is read. Credentials and endpoints come from the environment
    (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...) and
    --storage-option.

    \b
    Example:
      ddp-even plan file:///data/train --world-size 8 --batch-size 256 --sharding rows
      AWS_ENDPOINT_URL=http://127.0.0.1:9000 ddp-even plan s3://bucket/train -w 8 -b 256
      ddp-even plan s3://bucket/train -w 8 -b 256 --storage-option endpoint_url=http://minio:9000
    """
    if as_json and output_format not in ("table", "json"):
        raise click.BadParameter(
            f"--json contradicts --format {output_format}", param_hint="--json"
        )
    chosen_format = "json" if as_json else output_format
    location: str | list[str] = dataset[0] if len(dataset) == 1 else list(dataset)
    options = _storage_options(storage_option)
    # Imported only now (see the module docstring): they take most of a second to import.
    from rich.console import Console

    from ddp_even.cli import tables
    from ddp_even.parquet.dataset_plan import plan_dataset
    from ddp_even.planning.sharding import SHARDINGS, sharding_from

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # said below, in CLI words
            chosen = sharding_from(sharding, True if balanced else None)
    except ValueError as error:
        raise click.BadParameter(
            f"--balanced contradicts --sharding {sharding}", param_hint="--balanced"
        ) from error
    if balanced:
        click.echo("--balanced is deprecated: use --sharding row_groups", err=True)
    try:
        with tables.metadata_progress(Console(stderr=True)) as progress:
            planned = plan_dataset(
                location,
                world_size,
                batch_size,
                sharding=chosen,
                storage_options=options or None,
                progress=progress,
            )
    except DatasetError as error:
        raise click.ClickException(str(error)) from error
    row_groups, plan = planned.footers, planned.plan
    round_robin = planned.for_ranks(world_size, "round_robin")
    too_many = round_robin.describe_too_many_ranks()
    if too_many is not None and SHARDINGS[chosen].is_petastorms:
        raise click.ClickException(
            f"{too_many}. Use --world-size {len(row_groups)} or less, --sharding rows, or write "
            f"the dataset with at least {world_size} row groups"
        )
    if chosen_format == "json":
        document = tables.json_document(location, row_groups, plan, round_robin)
        click.echo(json.dumps(document, indent=2))
        return
    header = tables.header_lines(location, row_groups, plan)
    found = tables.sections(plan, round_robin, row_groups, None if all_ranks else _MAX_LISTED)
    if chosen_format == "markdown":
        click.echo(tables.markdown(header, found))
        return
    tables.print_tables(Console(highlight=False), header, found)


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a nested dict: ``client_kwargs.endpoint_url=URL`` nests."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, separator, text = pair.partition("=")
        if not separator or not key:
            raise click.BadParameter(
                f"{pair!r} is not KEY=VALUE (for example endpoint_url=http://127.0.0.1:9000)",
                param_hint="--storage-option",
            )
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.split(".")
        level = options
        for parent in parents:
            nested = level.setdefault(parent, {})
            if not isinstance(nested, dict):
                raise click.BadParameter(
                    f"{key!r}: {parent!r} is already a value", param_hint="--storage-option"
                )
            level = nested
        level[leaf] = value
    return options
