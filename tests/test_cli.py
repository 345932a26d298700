"""``ddp-even plan``: tables for people, JSON for scripts, one-line errors that say what to do.

Most tests call the command in this process; those about start-up, piped output and remote
failures run ``python -m ddp_even`` as a person would, in a fresh process with its output piped.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

import ddp_even
from ddp_even.cli import main, tables
from ddp_even.parquet import plan_for_dataset
from ddp_even.storage import _metadata_server_answers
from tests.helpers.datasets import write_plain_dataset

ROOT = Path(__file__).resolve().parent.parent

# Round robin over 2 ranks: rank 0 gets 40+30+1+4 = 75 rows, rank 1 gets 3+5+6+2 = 16.
SIZES = [[40, 3], [30, 5], [1, 6, 4, 2]]


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", *args], catch_exceptions=False)


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    return write_plain_dataset(tmp_path / "ds", SIZES)


@pytest.mark.timeout(30)
def test_tables(dataset: str) -> None:
    result = run(dataset, "--world-size", "2", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "91 rows in 8 row groups, 3 files (from footers)" in out
    assert "Ranks" in out and "Per epoch" in out
    assert "75" in out and "16" in out  # rows per rank
    for mode in ("truncate", "cycle", "pad", "join"):
        assert mode in out
    # truncate: 2 steps; rank 0 drops 10 - 2 = 8 batches, 75 - 16 = 59 rows.
    assert "8 / 59" in out
    # pad: 10 steps; rank 1 pads 8 batches, each a copy of its last (full) batch of 8 rows.
    assert "8 / 64" in out
    assert "padded rank-steps" in " ".join(out.split())
    assert "Round robin vs balanced" not in out


@pytest.mark.timeout(30)
def test_balanced_shows_the_comparison(dataset: str) -> None:
    result = run(dataset, "-w", "2", "-b", "8", "--sharding", "row_groups")
    assert result.exit_code == 0, result.output
    assert "Round robin vs balanced row groups" in result.output
    assert "batch size 8, balanced row groups" in " ".join(result.output.split())


@pytest.mark.timeout(30)
def test_where_round_robin_fails_the_comparison_says_so_instead_of_numbers(
    dataset: str,
) -> None:
    """8 row groups on 9 ranks: plain ``plan`` refuses round robin (every rank's petastorm
    reader raises), so the table beside ``--sharding rows`` shows no round robin numbers."""
    refused = run(dataset, "-w", "9", "-b", "8")
    assert refused.exit_code == 1 and "NoDataAvailableError" in refused.output
    result = run(dataset, "-w", "9", "-b", "8", "--sharding", "rows")
    assert result.exit_code == 0, result.output
    comparison = result.output.split("Round robin vs equal row ranges", 1)[1]
    rows = [line for line in comparison.splitlines() if line.startswith("│ ")]
    assert len(rows) > 4 and all(line.split("│")[2].strip() == "fails" for line in rows)
    assert "Round robin fails: world size 9 is larger than the 8 row groups" in " ".join(
        comparison.split()
    )
    document = json.loads(run(dataset, "-w", "9", "-b", "8", "--sharding", "rows", "--json").output)
    assert set(document["round_robin"]) == {"fails"}


@pytest.mark.timeout(30)
def test_deprecated_balanced_flag_still_works(dataset: str) -> None:
    result = CliRunner().invoke(main, ["plan", dataset, "-w", "2", "-b", "8", "--balanced"])
    assert result.exit_code == 0, result.output
    assert "--balanced is deprecated: use --sharding row_groups" in result.output
    assert "Round robin vs balanced row groups" in result.output
    clash = run(dataset, "-w", "2", "-b", "8", "--balanced", "--sharding", "rows")
    assert clash.exit_code == 2 and "--balanced contradicts --sharding rows" in clash.output


@pytest.mark.timeout(30)
def test_rows_prints_the_split_row_groups(dataset: str) -> None:
    # 91 rows over 3 ranks: 30, 30, 31. Row groups in order: 40, 3 | 30, 5 | 1, 6, 4, 2.
    result = run(dataset, "-w", "3", "-b", "8", "--sharding", "rows")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "Split row groups" in out and "equal row ranges" in out
    # Row group 0 (40 rows) is split 0-30 / 30-40; row group 2 (30 rows, rows 43-73 of the
    # epoch) is split 0-17 / 17-30 at row 60.
    assert "0: 0-30; 1: 30-40" in out and "1: 0-17; 2: 17-30" in out
    assert "2 split row group(s)" in out
    document = json.loads(run(dataset, "-w", "3", "-b", "8", "--sharding", "rows", "--json").output)
    assert document["plan"]["rows_per_rank"] == [30, 30, 31]
    assert document["plan"]["sharding"] == "rows"
    assert document["plan"]["row_ranges_per_rank"] == [
        [[0, 0, 30]],
        [[0, 30, 40], [2, 0, 17]],
        [[2, 17, 30]],
    ]


@pytest.mark.timeout(30)
def test_rows_with_more_ranks_than_row_groups_is_a_plan(dataset: str) -> None:
    document = json.loads(
        run(dataset, "-w", "10", "-b", "4", "--sharding", "rows", "--json").output
    )
    assert document["plan"]["rows_per_rank"] == [9] * 9 + [10]
    assert document["plan"]["petastorm_error"] is None


@pytest.mark.timeout(30)
def test_json(dataset: str) -> None:
    result = run(dataset, "-w", "2", "-b", "8", "--sharding", "row_groups", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["metadata_source"] == "footers"
    assert document["round_robin"]["rows_per_rank"] == [75, 16]
    assert document["round_robin"]["modes"]["truncate"]["dropped_rows"] == [59, 0]
    pad = document["round_robin"]["modes"]["pad"]
    assert (pad["steps"], pad["padded_batches"], pad["padded_rows"]) == (10, [0, 8], [0, 64])
    assert pad["waste_percent"] == 40.0  # 8 of 20 rank-steps
    assert sorted(document["plan"]["rows_per_rank"]) == [45, 46]
    assert document["plan"]["sharding"] == "row_groups"
    every = sorted(i for shard in document["plan"]["row_groups_per_rank"] for i in shard)
    assert every == list(range(8))


@pytest.mark.timeout(30)
def test_json_without_balanced_has_no_comparison(dataset: str) -> None:
    document = json.loads(run(dataset, "-w", "3", "-b", "4", "--json").output)
    assert "round_robin" not in document
    # Rank 0: 40+5+4 = 49 rows, rank 1: 3+1+2 = 6, rank 2: 30+6 = 36; batches of 4.
    assert document["plan"]["batches_per_rank"] == [13, 2, 9]


@pytest.mark.timeout(30)
def test_several_files_keep_their_order(tmp_path: Path, dataset: str) -> None:
    files = [str(tmp_path / "ds" / f"part-0000{k}.parquet") for k in (2, 0)]
    document = json.loads(run(*files, "-w", "1", "-b", "4", "--json").output)
    assert document["plan"]["total_rows"] == 13 + 43
    assert document["num_files"] == 2


@pytest.mark.timeout(30)
def test_many_ranks_are_summarised(tmp_path: Path) -> None:
    url = write_plain_dataset(tmp_path / "many", [[3] * 40])
    summary = run(url, "-w", "40", "-b", "2")
    assert summary.exit_code == 0, summary.output
    assert "Ranks (40, summarised)" in summary.output and "--all-ranks" in summary.output
    assert "fewest rows" in summary.output and "most rows" in summary.output
    full = run(url, "-w", "40", "-b", "2", "--all-ranks")
    assert full.exit_code == 0
    assert "Ranks (40, summarised)" not in full.output
    assert "│   39 │" in full.output


@pytest.mark.timeout(30)
def test_missing_path(tmp_path: Path) -> None:
    result = run(str(tmp_path / "nope"), "-w", "2", "-b", "4")
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert "does not exist: check the path" in result.output
    assert result.output.strip().count("\n") == 0


@pytest.mark.timeout(30)
def test_not_parquet(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    result = run(str(tmp_path / "data.csv"), "-w", "2", "-b", "4")
    assert result.exit_code == 1
    assert "not a readable Parquet file" in result.output
    assert result.output.strip().count("\n") == 0


@pytest.mark.timeout(30)
def test_more_ranks_than_row_groups(dataset: str) -> None:
    result = run(dataset, "-w", "10", "-b", "4")
    assert result.exit_code == 1
    out = result.output
    assert out.strip().count("\n") == 0
    for words in (
        "world size 10 is larger than the 8 row groups",
        "petastorm's own readers (cur_shard/shard_count) raise NoDataAvailableError",
        "from_parquet reads the same shards with empty ranks: rank(s) 8, 9 get no rows",
        "truncate runs 0 steps",
        "cycle cannot run",
        "join trains on 8 rank(s)",
        "Use --world-size 8 or less, --sharding rows",
    ):
        assert words in out


@pytest.mark.timeout(30)
def test_bad_world_size_is_a_usage_error(dataset: str) -> None:
    result = run(dataset, "-w", "0", "-b", "4")
    assert result.exit_code == 2
    assert "--world-size" in result.output


# --- in a fresh process, as a person runs it -----------------------------------------------

# What a terminal or a person's environment may set that would change what is measured here.
_UNSET = ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TERM_PROGRAM")


def ddp_even_command(
    *args: str,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    importtime: bool = False,
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m ddp_even ARGS`` with its output piped; the result and the seconds it took."""
    dropped = {*_UNSET, *unset}
    environment = {key: value for key, value in os.environ.items() if key not in dropped}
    environment["PYTHONPATH"] = str(ROOT)  # this checkout's ddp_even, as the tests import it
    environment.update(env or {})
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "ddp_even"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, time.perf_counter() - started


def imported(*args: str) -> set[str]:
    """The top-level packages ``python -m ddp_even ARGS`` imports (``-X importtime``)."""
    done, _ = ddp_even_command(*args, importtime=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines}


@pytest.mark.timeout(120)
def test_help_version_and_python_dash_m() -> None:
    for args in (["-h"], ["--help"], ["plan", "-h"], ["plan", "--help"]):
        answer = CliRunner().invoke(main, args, prog_name="python -m ddp_even")
        assert answer.exit_code == 0, (args, answer.output)
        assert answer.output.startswith("Usage: python -m ddp_even"), answer.output
    plan_help, _ = ddp_even_command("plan", "-h")
    assert plan_help.returncode == 0 and plan_help.stdout.startswith("Usage: python -m ddp_even")
    assert "--world-size" in plan_help.stdout
    assert "--format [table|markdown|json]" in plan_help.stdout
    version, _ = ddp_even_command("--version")
    assert (
        version.returncode == 0 and version.stdout == f"ddp-even, version {ddp_even.__version__}\n"
    )
    usage, _ = ddp_even_command("plan", "somewhere")
    assert usage.returncode == 2 and "Missing option '--world-size'" in usage.stderr


@pytest.mark.timeout(120)
def test_start_up_imports_no_torch(dataset: str) -> None:
    # Help and usage errors need click alone; a plan needs the planner, never torch. How quick
    # they are is measured by benchmarks/bench_cli.py (docs/performance.md, "CLI start-up").
    assert not imported("plan", "--help") & {"torch", "numpy", "pyarrow", "rich"}
    planned = imported("plan", dataset, "-w", "2", "-b", "8")
    assert "pyarrow" in planned and "torch" not in planned


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharding", ["round_robin", "row_groups", "rows", "replicate"])
def test_piped_tables_fit_80_columns(dataset: str, sharding: str) -> None:
    done, _ = ddp_even_command("plan", dataset, "-w", "3", "-b", "8", "--sharding", sharding)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, done.stdout
    assert "…" not in done.stdout, "nothing is cut"
    for mode in ("truncate", "cycle", "join"):
        assert re.search(rf"^│ {mode} +│", done.stdout, re.M), f"{mode} is whole in its row"
    assert "red:" not in done.stdout, "no colours, so no legend"


@pytest.mark.timeout(30)
def test_the_legend_comes_with_colours(dataset: str) -> None:
    row_groups, plan = plan_for_dataset(dataset, world_size=2, batch_size=8)
    found = tables.sections(plan, plan, row_groups, most_listed=32)
    header = tables.header_lines(dataset, row_groups, plan)
    for colours, legend in (("standard", True), (None, False)):
        out = io.StringIO()
        console = Console(file=out, width=80, force_terminal=True, color_system=colours)
        tables.print_tables(console, header, found)
        assert ("(red: fewest rows, yellow: most)" in out.getvalue()) is legend


@pytest.mark.timeout(30)
def test_notes_follow_the_sharding(dataset: str) -> None:
    def notes(sharding: str) -> str:
        result = run(dataset, "-w", "2", "-b", "8", "--sharding", sharding)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    bound = "With whole row groups the fullest rank holds at least"
    assert f"Spread 59 rows between the fullest and the emptiest rank. {bound} 46 rows" in notes(
        "round_robin"
    )
    assert bound in notes("row_groups")
    assert bound not in notes("rows") and "Every rank reads 45 or 46 rows" in notes("rows")
    replicated = notes("replicate")
    assert bound not in replicated and "Every rank reads all 91 rows" in replicated


@pytest.mark.timeout(30)
def test_markdown(dataset: str) -> None:
    result = run(dataset, "-w", "2", "-b", "8", "--format", "markdown")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"## {dataset}"
    assert "### Ranks" in lines and "### Per epoch" in lines
    assert "| 0 | 4 | 75 | 10 |" in result.output  # rank 0: 4 row groups, 75 rows, 10 batches
    assert "| truncate | 2 | 8 / 59 | 0 / 0 | 0 / 0 | 0 | 64.83 |" in lines
    # pad: rank 1 hands out its last batch (8 rows) again at 8 steps, 8 of 20 rank-steps.
    assert "| pad | 10 | 0 / 0 | 0 / 0 | 8 / 64 | 0 | 40.00 |" in lines
    assert any(line.startswith("- **cycle**: ") for line in lines)
    clash = run(dataset, "-w", "2", "-b", "8", "--format", "markdown", "--json")
    assert clash.exit_code == 2 and "--json contradicts --format markdown" in clash.output


@pytest.mark.timeout(60)
@pytest.mark.skipif(_metadata_server_answers(), reason="on Google Cloud: there are credentials")
def test_gcs_without_credentials_fails_fast_in_one_whole_line(tmp_path: Path) -> None:
    # No emulator, no key file, no gcloud configuration: what a new user without GCS has.
    env = {"HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}
    unset = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_ROOT")
    done, seconds = ddp_even_command(
        "plan", "gs://bucket/train", "-w", "2", "-b", "4", env=env, unset=unset
    )
    assert done.returncode == 1
    assert seconds < 10
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("Error: gs://bucket/train: no Google Cloud credentials found")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in done.stderr and "token='anon'" in done.stderr
    assert done.stderr.rstrip().endswith("for an emulator set STORAGE_EMULATOR_HOST")
