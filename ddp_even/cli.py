"""``ddp-even``: see how a dataset's shards come out before training.

``ddp-even plan URL --world-size N --batch-size B [--sharding S] [--json] [--all-ranks]``
prints one table of ranks (row groups, rows, batches) and one of modes (steps, dropped,
repeated, padded, waste), from Parquet metadata only. ``--sharding`` (``round_robin``,
``row_groups``, ``rows``, ``replicate``; see :mod:`ddp_even.planning.sharding`) plans other
shards than petastorm's round robin and compares them with it; with ``rows`` a table lists the
row groups split between ranks and each rank's range of them. ``--balanced`` is the deprecated
spelling of ``--sharding row_groups``. ``--json`` prints the same for scripts.

Remote datasets (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ...) take their credentials
and endpoint from the environment (``AWS_*`` including ``AWS_ENDPOINT_URL``,
``GOOGLE_APPLICATION_CREDENTIALS``, ...) and from ``--storage-option KEY=VALUE``, which fills
the same ``storage_options`` dict petastorm takes (``client_kwargs.endpoint_url=URL`` nests).
Reading metadata that takes more than a second shows a progress bar on stderr.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ddp_even.errors import DatasetError
from ddp_even.modes import MODES
from ddp_even.planning.metadata import read_row_groups
from ddp_even.planning.plans import ShardPlan, plan_shards
from ddp_even.planning.row_groups import RowGroups
from ddp_even.planning.sharding import SHARDINGS, sharding_from

__all__ = ["main"]

# Beyond this many ranks the rank table shows a summary unless --all-ranks is given.
_MAX_LISTED_RANKS = 32
_BAR_WIDTH = 20
# Metadata reads faster than this show no progress bar (a local dataset, a small remote one).
_PROGRESS_AFTER_S = 1.0


@click.group()
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
    type=click.Choice(list(SHARDINGS)),
    default="round_robin",
    show_default=True,
    help="Who reads what: petastorm's round robin, whole balanced row groups, equal row "
    "ranges (rows), or every row group on every rank (replicate).",
)
@click.option("--balanced", is_flag=True, help="Deprecated: the same as --sharding row_groups.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--all-ranks", is_flag=True, help=f"List every rank even beyond {_MAX_LISTED_RANKS}.")
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
    sharding: str,
    balanced: bool,
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
    location: str | list[str] = dataset[0] if len(dataset) == 1 else list(dataset)
    options = _storage_options(storage_option)
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
        with _MetadataProgress(Console(stderr=True)) as progress:
            row_groups = read_row_groups(
                location, storage_options=options or None, progress=progress
            )
    except DatasetError as error:
        raise click.ClickException(str(error)) from error
    round_robin = plan_shards(row_groups, world_size, batch_size)
    too_many = round_robin.describe_too_many_ranks()
    if too_many is not None and SHARDINGS[chosen].is_petastorms:
        raise click.ClickException(
            f"{too_many}. Use --world-size {len(row_groups)} or less, --sharding rows, or write "
            f"the dataset with at least {world_size} row groups"
        )
    plan = plan_shards(row_groups, world_size, batch_size, sharding=chosen)
    if as_json:
        click.echo(json.dumps(_as_json(location, row_groups, plan, round_robin), indent=2))
        return
    console = Console(highlight=False)
    console.print(_header(location, row_groups, plan))
    console.print(_rank_table(plan, all_ranks))
    if plan.row_ranges:
        console.print(_split_table(plan, row_groups, all_ranks))
    console.print(_mode_table(plan))
    if not SHARDINGS[plan.sharding].is_petastorms:
        console.print(_comparison_table(round_robin, plan))


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


class _MetadataProgress:
    """A progress bar for metadata reads, shown only once they have taken over a second."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._started = time.monotonic()
        self._display: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> _MetadataProgress:
        return self

    def __call__(self, done: int, total: int) -> None:
        if self._display is None:
            if not self._console.is_terminal:  # a log file gets no redrawn bar
                return
            if time.monotonic() - self._started < _PROGRESS_AFTER_S or done >= total:
                return
            self._display = Progress(
                TextColumn("reading Parquet metadata"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
            )
            self._display.start()
            self._task = self._display.add_task("metadata", total=total)
        self._display.update(self._task, completed=done, total=total)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._display is not None:
            self._display.stop()


def _as_json(
    location: str | list[str], row_groups: RowGroups, plan: ShardPlan, round_robin: ShardPlan
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "dataset": location,
        "metadata_source": row_groups.source,
        "num_files": len(row_groups.files),
        "plan": plan.to_dict(),
    }
    if not SHARDINGS[plan.sharding].is_petastorms:
        document["round_robin"] = round_robin.to_dict()
    return document


def _header(location: str | Sequence[str], row_groups: RowGroups, plan: ShardPlan) -> Text:
    name = location if isinstance(location, str) else f"{len(location)} files"
    sharding = SHARDINGS[plan.sharding].label
    return Text.assemble(
        (str(name), "bold"),
        f"\n{plan.num_row_groups:,} row groups in {len(row_groups.files):,} file(s) "
        f"(from {row_groups.source}), {plan.total_rows:,} rows; "
        f"{plan.world_size} ranks, batch size {plan.batch_size:,}; {sharding}",
    )


def _rank_table(plan: ShardPlan, all_ranks: bool) -> Table:
    if plan.world_size > _MAX_LISTED_RANKS and not all_ranks:
        return _rank_summary_table(plan)
    fewest, most = min(plan.rows_per_rank), max(plan.rows_per_rank)
    table = Table(title="Ranks", title_justify="left")
    for column in ("rank", "row groups", "rows", "batches"):
        table.add_column(column, justify="right")
    table.add_column("rows (bar = most)", justify="left")
    for rank in range(plan.world_size):
        rows = plan.rows_per_rank[rank]
        style = "red" if rows == fewest and fewest != most else ""
        style = "yellow" if rows == most and fewest != most else style
        table.add_row(
            str(rank),
            f"{plan.row_group_counts[rank]:,}",
            f"{rows:,}",
            f"{plan.batches_per_rank[rank]:,}",
            _bar(rows, most),
            style=style,
        )
    bound = (
        f"lower bound for the fullest rank {plan.lower_bound_rows:,} rows; "
        if SHARDINGS[plan.sharding].keeps_row_groups_whole
        else ""
    )
    table.caption = f"spread {plan.spread_rows:,} rows; {bound}(red: fewest, yellow: most)"
    return table


def _rank_summary_table(plan: ShardPlan) -> Table:
    rows = plan.rows_per_rank
    order = sorted(range(plan.world_size), key=lambda rank: (rows[rank], rank))
    picks = [
        ("fewest rows", order[0]),
        ("median", order[len(order) // 2]),
        ("most rows", order[-1]),
    ]
    table = Table(title=f"Ranks ({plan.world_size}, summarised)", title_justify="left")
    for column in ("", "rank", "row groups", "rows", "batches"):
        table.add_column(column, justify="right")
    for label, rank in picks:
        table.add_row(
            label,
            str(rank),
            f"{plan.row_group_counts[rank]:,}",
            f"{rows[rank]:,}",
            f"{plan.batches_per_rank[rank]:,}",
        )
    batches = plan.batches_per_rank
    at_fewest = sum(1 for n in batches if n == min(batches))
    table.caption = (
        f"{at_fewest} rank(s) have the fewest batches ({min(batches):,}); spread "
        f"{plan.spread_rows:,} rows; --all-ranks lists every rank"
    )
    return table


def _mode_table(plan: ShardPlan) -> Table:
    table = Table(title="Per epoch", title_justify="left")
    table.add_column("mode")
    for column in (
        "steps",
        "dropped (batches / rows)",
        "repeated (batches / rows)",
        "padded (batches / rows)",
        "idle rank-steps",
    ):
        table.add_column(column, justify="right")
    table.add_column("waste %", justify="right")
    notes = []
    for mode in MODES:
        stats = plan.stats(mode)
        table.add_row(
            mode,
            f"{stats.steps:,}",
            f"{sum(stats.dropped_batches):,} / {stats.total_dropped_rows:,}",
            f"{sum(stats.repeated_batches):,} / {stats.total_repeated_rows:,}",
            f"{sum(stats.padded_batches):,} / {sum(stats.padded_rows):,}",
            f"{sum(stats.idle_steps):,}",
            f"{stats.waste_percent:.2f}",
            style="" if stats.runnable else "red",
        )
        notes.append(f"{mode}: {stats.note}")
    table.caption = "waste: " + _waste_meanings() + "\n" + "\n".join(notes)
    return table


def _number(value: float) -> str:
    return f"{value:.2f}" if isinstance(value, float) else f"{value:,}"


def _waste_meanings() -> str:
    return "; ".join(f"{name}: {mode.waste_means}" for name, mode in MODES.items())


def _split_table(plan: ShardPlan, row_groups: RowGroups, all_ranks: bool) -> Table:
    """The row groups ``"rows"`` sharding splits, and which rows of each every rank reads."""
    ranks_of: dict[int, list[tuple[int, int, int]]] = {}
    for rank in range(plan.world_size):
        for group, start, stop in plan.row_ranges_of(rank):
            ranks_of.setdefault(group, []).append((rank, start, stop))
    table = Table(
        title="Split row groups (each read whole by every rank listed)", title_justify="left"
    )
    for column in ("row group", "file #", "rows"):
        table.add_column(column, justify="right")
    table.add_column("rank: rows [start, stop)")
    listed = sorted(ranks_of.items())
    shown = listed if all_ranks or len(listed) <= _MAX_LISTED_RANKS else listed[:_MAX_LISTED_RANKS]
    for group, pieces in shown:
        where = row_groups[group]
        table.add_row(
            str(group),
            f"{where.path.rsplit('/', 1)[-1]} #{where.index_in_file}",
            f"{where.num_rows:,}",
            "; ".join(f"{rank}: {start:,}-{stop:,}" for rank, start, stop in pieces),
        )
    table.caption = (
        f"{len(listed):,} split row group(s) (at most world size - 1): that many extra row-group "
        "reads per epoch"
        + (f"; first {len(shown)} shown, --all-ranks lists all" if len(shown) < len(listed) else "")
    )
    return table


def _comparison_table(round_robin: ShardPlan, planned: ShardPlan) -> Table:
    name = SHARDINGS[planned.sharding].label
    table = Table(title=f"Round robin vs {name}", title_justify="left")
    table.add_column("")
    table.add_column("round robin", justify="right")
    table.add_column(name, justify="right")
    metrics: list[tuple[str, Any]] = [
        ("fewest rows on a rank", lambda p: min(p.rows_per_rank)),
        ("most rows on a rank", lambda p: max(p.rows_per_rank)),
        ("spread (rows)", lambda p: p.spread_rows),
        ("spread (batches)", lambda p: max(p.batches_per_rank) - min(p.batches_per_rank)),
    ]
    for name in MODES:
        metrics.append((f"{name}: steps", lambda p, name=name: p.steps(name)))
        metrics.append((f"{name}: waste %", lambda p, name=name: p.stats(name).waste_percent))
    for label, metric in metrics:
        table.add_row(label, _number(metric(round_robin)), _number(metric(planned)))
    table.caption = (
        f"lower bound for the fullest rank with whole row groups: {planned.lower_bound_rows:,} "
        "rows (the larger of ceil(total rows / ranks) and the largest row group); waste: "
        + _waste_meanings()
    )
    return table


def _bar(value: int, largest: int) -> str:
    if largest <= 0:
        return ""
    eighths = round(_BAR_WIDTH * 8 * value / largest)
    full, rest = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[rest]


if __name__ == "__main__":
    main()
