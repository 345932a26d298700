"""A dataset's refusals do not mention petastorm where it is not installed.

On the numpy-2 stack (no petastorm) a CSV in the dataset was refused with "rename it ... so
that petastorm skips it too": petastorm is not there. Every refusal of a dataset's layout or
metadata now says what is wrong and what to do on its own, and compares with petastorm only
where petastorm can be imported. Each case is run with petastorm hidden (``find_spec`` says it
is missing) and shown, whatever this environment has installed, and once as it is.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddp_even import DatasetError
from ddp_even.parquet import read_row_groups
from ddp_even.planning.row_groups import ROW_GROUPS_PER_FILE_KEY

TABLE = pa.table({"id": pa.array(range(6), pa.int64())})


def _data(root: Path, name: str = "a.parquet") -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(TABLE, root / name)


def _csv(root: Path) -> Any:
    _data(root)
    (root / "notes.csv").write_text("id\n1\n")
    return root


def _files_and_directories(root: Path) -> Any:
    _data(root)
    _data(root, "x=1/b.parquet")
    return root


def _not_a_partition(root: Path) -> Any:
    _data(root, "sub/b.parquet")
    return root


def _two_summaries(root: Path) -> Any:
    _data(root, "x=1/a.parquet")
    _data(root, "x=2/b.parquet")
    for where in ("x=1", "x=2"):
        pq.write_metadata(TABLE.schema, root / where / "_metadata")
    return root


def _unreadable_summary(root: Path) -> Any:
    _data(root)
    (root / "_metadata").write_bytes(b"not parquet")
    return root


def _summary_without_counts(root: Path) -> Any:
    _data(root)
    pq.write_metadata(TABLE.schema, root / "_common_metadata")
    return root


def _file_missing_from_counts(root: Path) -> Any:
    _data(root)
    _data(root, "b.parquet")
    counts = json.dumps({"a.parquet": 1}).encode()
    schema = TABLE.schema.with_metadata({ROW_GROUPS_PER_FILE_KEY: counts})
    pq.write_metadata(schema, root / "_common_metadata")
    return root


def _summary_of_other_files(root: Path) -> Any:
    _data(root)
    collected: list[pq.FileMetaData] = []
    pq.write_table(TABLE, root / "elsewhere.tmp", metadata_collector=collected)
    (root / "elsewhere.tmp").unlink()
    collected[0].set_file_path("gone.parquet")
    pq.write_metadata(TABLE.schema, root / "_metadata", metadata_collector=collected)
    return root


def _no_row_groups(root: Path) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    pq.ParquetWriter(str(root / "a.parquet"), TABLE.schema).close()
    return root


def _two_filesystems(root: Path) -> Any:
    _data(root)
    return [(root / "a.parquet").as_uri(), "s3://bucket/b.parquet"]


CASES: dict[str, tuple[Callable[[Path], Any], str]] = {
    "a csv file": (_csv, "so that it is skipped"),
    "files beside directories": (_files_and_directories, "move the files into a partition"),
    "a directory that is no partition": (_not_a_partition, "is not a hive partition directory"),
    "two summaries": (_two_summaries, "keep only the one at the dataset root"),
    "an unreadable summary": (_unreadable_summary, "delete or regenerate it"),
    "a summary without counts": (_summary_without_counts, "has no row-group counts"),
    "a file missing from the counts": (_file_missing_from_counts, "missing from the row-group"),
    "a summary of other files": (_summary_of_other_files, "nothing would be read"),
    "no row groups": (_no_row_groups, "there is nothing to read"),
    "two filesystems": (_two_filesystems, "a dataset is read through one"),
}


def _refusal(tmp_path: Path, case: str) -> str:
    build, words = CASES[case]
    with pytest.raises(DatasetError) as refused:
        read_row_groups(build(tmp_path / "ds"))
    # Without the paths, which hold the test's name.
    message = str(refused.value).replace(str(tmp_path), "<tmp>")
    assert words in message and "\n" not in message, message
    return message


def _petastorm(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "petastorm":
            return real("json") if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("case", list(CASES))
def test_without_petastorm_no_refusal_mentions_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _petastorm(monkeypatch, installed=False)
    assert "petastorm" not in _refusal(tmp_path, case)


@pytest.mark.parametrize("case", ["a csv file", "a directory that is no partition"])
def test_with_petastorm_a_refusal_says_what_petastorm_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _petastorm(monkeypatch, installed=True)
    assert "(petastorm " in _refusal(tmp_path, case)


def test_a_csv_is_refused_as_this_environment_has_petastorm_or_not(tmp_path: Path) -> None:
    message = _refusal(tmp_path, "a csv file")
    installed = importlib.util.find_spec("petastorm") is not None
    assert ("petastorm" in message) == installed, message
