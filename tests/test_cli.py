"""``ddp-even plan``: tables for people, JSON for scripts, one-line errors that say what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ddp_even.cli import main
from tests.helpers.datasets import write_plain_dataset

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
    assert "8 row groups in 3 file(s) (from footers), 91 rows" in out
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
    assert "batch size 8; balanced row groups" in " ".join(result.output.split())


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
        "NoDataAvailableError",
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
