"""What ``ddp-even plan`` prints: tables for people, Markdown, or JSON for scripts.

Each table is built once as a :class:`Section` (title, columns, rows, notes under it) and then
rendered with rich (:func:`print_tables`: colours on a terminal, 80 columns when piped) or as
Markdown (:func:`markdown`), so both formats say the same. What a note says comes from the
registries: a sharding's flags (:data:`~ddp_even.planning.sharding.SHARDINGS`) decide which
bounds apply to it, each mode (:data:`~ddp_even.modes.MODES`) says what it does and what its
waste measures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from ddp_even.modes import MODES
from ddp_even.planning.plans import ShardPlan
from ddp_even.planning.row_groups import Progress, RowGroups
from ddp_even.planning.sharding import SHARDINGS

__all__ = [
    "Column",
    "Section",
    "header_lines",
    "json_document",
    "markdown",
    "metadata_progress",
    "print_tables",
    "sections",
]

_BAR_WIDTH = 20
# Metadata reads faster than this show no progress bar (a local dataset, a small remote one).
_PROGRESS_AFTER_S = 1.0


@dataclass(frozen=True)
class Column:
    """A table column: its header (``\\n`` breaks it in a terminal) and how cells sit."""

    header: str
    numeric: bool = True
    #: Never wrapped or cut: the column is as wide as its longest cell (mode names, ranks).
    whole: bool = False


# A rank's columns, in the table of every rank and in the summary of many.
_RANK_COLUMNS = (
    Column("rank", whole=True),
    Column("row groups"),
    Column("rows"),
    Column("batches"),
)


@dataclass
class Section:
    """One table of the plan, and the sentences that go under it."""

    title: str
    columns: tuple[Column, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    #: A rich style per row ("" for none); colour only, so nothing depends on it.
    styles: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: What the row colours mean; printed only where colours are shown.
    legend: str | None = None
    #: ``(name, meaning)`` pairs listed under the table, one per row name.
    key: list[tuple[str, str]] = field(default_factory=list)

    def add_row(self, *cells: str, style: str = "") -> None:
        self.rows.append(cells)
        self.styles.append(style)


def header_lines(
    location: str | Sequence[str], row_groups: RowGroups, plan: ShardPlan
) -> list[str]:
    """The dataset, what was read of it, and what is planned: a line each."""
    name = location if isinstance(location, str) else f"{len(location)} files"
    files = len(row_groups.files)
    return [
        name,
        f"{plan.total_rows:,} rows in {plan.num_row_groups:,} row groups, "
        f"{files:,} file{'s' if files != 1 else ''} (from {row_groups.source})",
        f"{plan.world_size:,} ranks, batch size {plan.batch_size:,}, "
        f"{SHARDINGS[plan.sharding].label}",
    ]


def sections(
    plan: ShardPlan, round_robin: ShardPlan, row_groups: RowGroups, most_listed: int | None
) -> list[Section]:
    """Every table of the plan: ranks, split row groups, modes, and round robin beside it
    (where petastorm's round robin cannot run, the table says so instead of its numbers).

    Beyond ``most_listed`` ranks the rank table is a summary, and only that many split row
    groups are listed (None: list them all).
    """
    found = [_rank_section(plan, most_listed)]
    if plan.row_ranges:
        found.append(_split_section(plan, row_groups, most_listed))
    found.append(_mode_section(plan))
    if not SHARDINGS[plan.sharding].is_petastorms:
        found.append(_comparison_section(round_robin, plan))
    return found


def print_tables(console: Console, header: Sequence[str], found: Sequence[Section]) -> None:
    """The sections as rich tables, fitted to ``console``'s width.

    Every string goes in as :class:`~rich.text.Text`: no markup or highlighting is read into
    file names or notes.
    """
    console.print(Text(header[0], style="bold"))
    for line in header[1:]:
        console.print(Text(line))
    for section in found:
        console.print()
        table = Table(title=section.title, title_justify="left", title_style="bold")
        for index, column in enumerate(section.columns):
            longest = max((len(row[index]) for row in section.rows), default=0)
            table.add_column(
                Text(column.header),
                justify="right" if column.numeric else "left",
                no_wrap=column.whole,
                min_width=max(longest, *map(len, column.header.split("\n")))
                if column.whole
                else None,
            )
        for row, style in zip(section.rows, section.styles, strict=True):
            table.add_row(*map(Text, row), style=style)
        console.print(table)
        for note in section.notes:
            console.print(Text(note))
        if section.legend and console.color_system is not None:
            console.print(Text(f"({section.legend})", style="dim"))
        if section.key:
            key = Table.grid(padding=(0, 1))
            key.add_column(no_wrap=True)
            key.add_column()
            for name, meaning in section.key:
                key.add_row(Text(f"{name}:"), Text(meaning))
            console.print(key)


def markdown(header: Sequence[str], found: Sequence[Section]) -> str:
    """The sections as Markdown: a heading, then a table and its notes per section."""
    lines = [f"## {header[0]}", "", *header[1:]]
    for section in found:
        lines += ["", f"### {section.title}", ""]
        lines.append("| " + " | ".join(_flat(column.header) for column in section.columns) + " |")
        lines.append(
            "|" + "|".join("---:" if column.numeric else "---" for column in section.columns) + "|"
        )
        lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in section.rows]
        extra = [*section.notes, *(f"- **{name}**: {meaning}" for name, meaning in section.key)]
        if extra:
            lines += ["", *extra]
    return "\n".join(lines)


def json_document(
    location: str | list[str], row_groups: RowGroups, plan: ShardPlan, round_robin: ShardPlan
) -> dict[str, Any]:
    """The plan as JSON-ready data; with another sharding, petastorm's round robin beside it."""
    document: dict[str, Any] = {
        "dataset": location,
        "metadata_source": row_groups.source,
        "num_files": len(row_groups.files),
        "plan": plan.to_dict(),
    }
    if not SHARDINGS[plan.sharding].is_petastorms:
        fails = round_robin.describe_too_many_ranks()
        document["round_robin"] = round_robin.to_dict() if fails is None else {"fails": fails}
    return document


@contextlib.contextmanager
def metadata_progress(console: Console) -> Iterator[Progress]:
    """A progress bar for metadata reads, shown only once they have taken over a second: the
    ``progress(done, total)`` callback to read with."""
    display = RichProgress(
        TextColumn("reading Parquet metadata"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = display.add_task("metadata", total=None)
    started = time.monotonic()

    def report(done: int, total: int) -> None:
        display.update(task, completed=done, total=total)
        if (
            not display.live.is_started
            and console.is_terminal  # a log file gets no redrawn bar
            and time.monotonic() - started >= _PROGRESS_AFTER_S
            and done < total
        ):
            display.start()

    try:
        yield report
    finally:
        if display.live.is_started:  # stopped, a bar never shown would print a line
            display.stop()


def _rank_section(plan: ShardPlan, most_listed: int | None) -> Section:
    if most_listed is not None and plan.world_size > most_listed:
        return _rank_summary_section(plan)
    fewest, most = min(plan.rows_per_rank), max(plan.rows_per_rank)
    section = Section(
        "Ranks",
        (*_RANK_COLUMNS, Column("rows (bar = most)", numeric=False)),
        notes=_rank_notes(plan),
        legend="red: fewest rows, yellow: most" if fewest != most else None,
    )
    for rank in range(plan.world_size):
        rows = plan.rows_per_rank[rank]
        style = "red" if rows == fewest and fewest != most else ""
        style = "yellow" if rows == most and fewest != most else style
        section.add_row(*_rank_cells(plan, rank), _bar(rows, most), style=style)
    return section


def _rank_cells(plan: ShardPlan, rank: int) -> tuple[str, ...]:
    """A rank's cells under :data:`_RANK_COLUMNS`."""
    return (
        str(rank),
        f"{len(plan.shards[rank]):,}",
        f"{plan.rows_per_rank[rank]:,}",
        f"{plan.batches_per_rank[rank]:,}",
    )


def _rank_notes(plan: ShardPlan) -> list[str]:
    """What bounds the rows per rank under this plan's sharding, and how far it is from them."""
    policy = SHARDINGS[plan.sharding]
    if policy.every_rank_reads_everything:
        return [f"Every rank reads all {plan.total_rows:,} rows, each in its own order."]
    fewest, most = plan.total_rows // plan.world_size, -(-plan.total_rows // plan.world_size)
    if not policy.keeps_row_groups_whole:
        share = f"{fewest:,}" if fewest == most else f"{fewest:,} or {most:,}"
        return [f"Every rank reads {share} rows: the total over the ranks, rounded."]
    return [
        f"Spread {plan.spread_rows:,} rows between the fullest and the emptiest rank. With "
        f"whole row groups the fullest rank holds at least {plan.lower_bound_rows:,} rows (the "
        "larger of the average and the largest row group)."
    ]


def _rank_summary_section(plan: ShardPlan) -> Section:
    rows = plan.rows_per_rank
    order = sorted(range(plan.world_size), key=lambda rank: (rows[rank], rank))
    batches = plan.batches_per_rank
    at_fewest = sum(1 for n in batches if n == min(batches))
    section = Section(
        f"Ranks ({plan.world_size}, summarised)",
        (Column("", numeric=False, whole=True), *_RANK_COLUMNS),
        notes=[
            f"{at_fewest} rank(s) have the fewest batches ({min(batches):,}); "
            "--all-ranks lists every rank.",
            *_rank_notes(plan),
        ],
    )
    for label, rank in (
        ("fewest rows", order[0]),
        ("median", order[len(order) // 2]),
        ("most rows", order[-1]),
    ):
        section.add_row(label, *_rank_cells(plan, rank))
    return section


def _mode_section(plan: ShardPlan) -> Section:
    every = {name: plan.stats(name) for name in MODES}
    section = Section(
        "Per epoch",
        (
            Column("mode", numeric=False, whole=True),
            Column("steps"),
            Column("dropped\nbatches / rows"),
            Column("repeated\nbatches / rows"),
            Column("padded\nbatches / rows"),
            Column("idle\nrank-steps"),
            Column("waste\n%"),
        ),
        legend=None if all(stats.runnable for stats in every.values()) else "red: cannot run",
    )
    for name, stats in every.items():
        section.add_row(
            name,
            f"{stats.steps:,}",
            f"{sum(stats.dropped_batches):,} / {stats.total_dropped_rows:,}",
            f"{sum(stats.repeated_batches):,} / {stats.total_repeated_rows:,}",
            f"{sum(stats.padded_batches):,} / {sum(stats.padded_rows):,}",
            f"{sum(stats.idle_steps):,}",
            f"{stats.waste_percent:.2f}",
            style="" if stats.runnable else "red",
        )
        section.key.append((name, f"{stats.note}; waste: {MODES[name].waste_means}"))
    return section


def _split_section(plan: ShardPlan, row_groups: RowGroups, most_listed: int | None) -> Section:
    """The row groups ``"rows"`` sharding splits, and which rows of each every rank reads."""
    ranks_of: dict[int, list[tuple[int, int, int]]] = {}
    for rank in range(plan.world_size):
        for group, start, stop in plan.row_ranges_of(rank):
            ranks_of.setdefault(group, []).append((rank, start, stop))
    listed = sorted(ranks_of.items())
    shown = listed[:most_listed] if most_listed is not None else listed
    section = Section(
        "Split row groups",
        (
            Column("row group", whole=True),
            Column("file #", numeric=False),
            Column("rows"),
            Column("rank: rows [start, stop)", numeric=False),
        ),
        notes=[
            f"{len(listed):,} split row group(s) (at most world size - 1), each read whole by "
            "every rank listed: that many extra row-group reads per epoch."
            + (f" First {len(shown)} shown; --all-ranks lists all." if shown != listed else "")
        ],
    )
    for group, pieces in shown:
        section.add_row(
            str(group),
            f"{row_groups.path_of(group).rsplit('/', 1)[-1]} #{row_groups.index_in_file[group]}",
            f"{row_groups.num_rows[group]:,}",
            "; ".join(f"{rank}: {start:,}-{stop:,}" for rank, start, stop in pieces),
        )
    return section


def _comparison_section(round_robin: ShardPlan, planned: ShardPlan) -> Section:
    label = SHARDINGS[planned.sharding].label
    section = Section(
        f"Round robin vs {label}",
        (
            Column("", numeric=False),
            Column("round robin", whole=True),
            Column(label, whole=True),
        ),
    )
    metrics: list[tuple[str, Any]] = [
        ("fewest rows on a rank", lambda p: min(p.rows_per_rank)),
        ("most rows on a rank", lambda p: max(p.rows_per_rank)),
        ("spread (rows)", lambda p: p.spread_rows),
        ("spread (batches)", lambda p: max(p.batches_per_rank) - min(p.batches_per_rank)),
    ]
    for name in MODES:
        metrics.append((f"{name}: steps", lambda p, name=name: p.steps(name)))
        metrics.append((f"{name}: waste %", lambda p, name=name: p.stats(name).waste_percent))
    fails = round_robin.describe_too_many_ranks()
    for text, metric in metrics:
        theirs = "fails" if fails is not None else _number(metric(round_robin))
        section.add_row(text, theirs, _number(metric(planned)))
    if fails is not None:
        section.notes.append(f"Round robin fails: {fails}.")
    return section


def _number(value: float) -> str:
    return f"{value:.2f}" if isinstance(value, float) else f"{value:,}"


def _bar(value: int, largest: int) -> str:
    if largest <= 0:
        return ""
    eighths = round(_BAR_WIDTH * 8 * value / largest)
    full, rest = divmod(eighths, 8)
    return "█" * full + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[rest]


def _flat(text: str) -> str:
    return _cell(" ".join(text.split("\n")))


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "
