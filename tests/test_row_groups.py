"""read_row_groups lists row groups exactly as petastorm 0.12.1 does, or says why it cannot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddp_even.errors import DatasetError
from ddp_even.parquet.metadata import read_row_groups
from ddp_even.planning.row_groups import ROW_GROUPS_PER_FILE_KEY
from tests.helpers.datasets import write_plain_dataset, write_unischema_dataset
from tests.helpers.shard_reads import write_summary_metadata

SIZES = [[5, 3, 8], [2], [6, 1, 4, 7]]


def petastorm_row_groups(url: str | list[str]) -> list[tuple[str, int]]:
    """(file, row group in file) in petastorm's own global order, from its own code."""
    from petastorm.etl.dataset_metadata import load_row_groups
    from petastorm.fs_utils import get_filesystem_and_path_or_paths
    from petastorm.reader import normalize_dataset_url_or_urls

    filesystem, path = get_filesystem_and_path_or_paths(normalize_dataset_url_or_urls(url))
    dataset = pq.ParquetDataset(path, filesystem=filesystem, validate_schema=False)
    return [(piece.path, piece.row_group) for piece in load_row_groups(dataset)]


def ours(url: Any) -> list[tuple[str, int]]:
    groups = read_row_groups(url)
    return [(groups.path_of(i), int(groups.index_in_file[i])) for i in range(len(groups))]


def footer_sizes(groups: Any) -> list[int]:
    return [
        pq.read_metadata(groups.path_of(i)).row_group(int(groups.index_in_file[i])).num_rows
        for i in range(len(groups))
    ]


def write_table(path: Path, sizes: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(str(path), pa.schema([("id", pa.int64())])) as writer:
        for size in sizes:
            writer.write_table(pa.table({"id": list(range(size))}), row_group_size=size)


def plain(tmp_path: Path) -> str:
    return write_plain_dataset(tmp_path / "ds", SIZES)


def partitioned(tmp_path: Path) -> str:
    return write_plain_dataset(tmp_path / "ds", SIZES, partition_by="part")


def unpadded_nested_partitions(tmp_path: Path) -> str:
    # Path order (k=1 < k=10 < k=2) differs from numeric order; two partition levels.
    root = tmp_path / "ds"
    for key, sizes in (("1", [3, 2]), ("10", [4]), ("2", [1, 5])):
        for sub in ("a", "b"):
            write_table(root / f"k={key}" / f"s={sub}" / "part.parquet", sizes)
    return root.as_uri()


def with_metadata(tmp_path: Path) -> str:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    write_summary_metadata(tmp_path / "ds", common=True)
    return url


def metadata_skipping_a_file(tmp_path: Path) -> str:
    # petastorm reads only files the _metadata lists: part-00001 drops out of the numbering.
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    write_summary_metadata(tmp_path / "ds", skip=("part-00001.parquet",))
    return url


def partitioned_with_metadata(tmp_path: Path) -> str:
    url = write_plain_dataset(tmp_path / "ds", SIZES, partition_by="part")
    write_summary_metadata(tmp_path / "ds")
    return url


def unischema(tmp_path: Path) -> str:
    return write_unischema_dataset(tmp_path / "ds", SIZES)


def with_ignored_files(tmp_path: Path) -> str:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    root = tmp_path / "ds"
    for name in ("_SUCCESS", ".part-00000.parquet.crc", "part-00000.parquet.crc", ".hidden"):
        (root / name).write_bytes(b"not parquet")
    (root / "_temporary").mkdir()
    (root / "_temporary" / "junk").write_bytes(b"not parquet")
    return url


def file_list_reversed(tmp_path: Path) -> list[str]:
    root = tmp_path / "ds"
    write_plain_dataset(root, SIZES)
    return [f"file://{path}" for path in sorted(map(str, root.glob("*.parquet")), reverse=True)]


def single_file(tmp_path: Path) -> str:
    write_plain_dataset(tmp_path / "ds", SIZES)
    return f"file://{tmp_path / 'ds' / 'part-00002.parquet'}"


LAYOUTS = [
    plain,
    partitioned,
    unpadded_nested_partitions,
    with_metadata,
    metadata_skipping_a_file,
    partitioned_with_metadata,
    unischema,
    with_ignored_files,
    file_list_reversed,
    single_file,
]


@pytest.mark.petastorm
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.__name__)
def test_order_and_sizes_match_petastorm(tmp_path: Path, layout: Any) -> None:
    url = layout(tmp_path)
    groups = read_row_groups(url)
    assert ours(url) == petastorm_row_groups(url)
    assert groups.num_rows.tolist() == footer_sizes(groups)


@pytest.mark.timeout(30)
@pytest.mark.petastorm
@pytest.mark.parametrize(
    ("layout", "source"),
    [(plain, "footers"), (with_metadata, "_metadata"), (unischema, "_common_metadata")],
)
def test_reports_which_metadata_it_used(tmp_path: Path, layout: Any, source: str) -> None:
    assert read_row_groups(layout(tmp_path)).source == source


@pytest.mark.timeout(30)
def test_metadata_skipping_a_file_leaves_it_out(tmp_path: Path) -> None:
    groups = read_row_groups(metadata_skipping_a_file(tmp_path))
    assert groups.num_rows.tolist() == [5, 3, 8, 6, 1, 4, 7]
    assert not any(path.endswith("part-00001.parquet") for path in groups.files)


@pytest.mark.timeout(30)
def test_paths_and_urls_give_the_same_row_groups(tmp_path: Path) -> None:
    url = plain(tmp_path)
    assert ours(url) == ours(str(tmp_path / "ds")) == ours(tmp_path / "ds") == ours(url + "/")


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_row_group_counts_key_is_petastorms() -> None:
    from petastorm.etl.dataset_metadata import ROW_GROUPS_PER_FILE_KEY as PETASTORM_KEY

    assert ROW_GROUPS_PER_FILE_KEY == PETASTORM_KEY


# --- Errors: one message that names the problem and what to do. ---


@pytest.mark.timeout(30)
def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        read_row_groups(tmp_path / "nope")


@pytest.mark.timeout(30)
def test_non_parquet_file_in_directory(tmp_path: Path) -> None:
    url = plain(tmp_path)
    (tmp_path / "ds" / "notes.txt").write_text("hello")
    with pytest.raises(DatasetError, match=r"notes\.txt is not a readable Parquet file"):
        read_row_groups(url)


@pytest.mark.timeout(30)
def test_non_parquet_single_file(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_row_groups(tmp_path / "data.csv")


@pytest.mark.timeout(30)
def test_files_next_to_partition_directories(tmp_path: Path) -> None:
    url = partitioned(tmp_path)
    write_table(tmp_path / "ds" / "stray.parquet", [3])
    with pytest.raises(DatasetError, match="both data files and subdirectories"):
        read_row_groups(url)


@pytest.mark.timeout(30)
def test_subdirectory_that_is_not_a_partition(tmp_path: Path) -> None:
    write_table(tmp_path / "ds" / "year2020" / "a.parquet", [3])
    with pytest.raises(DatasetError, match="not a hive partition directory"):
        read_row_groups(tmp_path / "ds")


@pytest.mark.timeout(30)
def test_common_metadata_without_row_group_counts(tmp_path: Path) -> None:
    url = plain(tmp_path)
    pq.write_metadata(pa.schema([("id", pa.int64())]), tmp_path / "ds" / "_common_metadata")
    with pytest.raises(DatasetError, match="no row-group counts"):
        read_row_groups(url)


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_common_metadata_missing_a_file(tmp_path: Path) -> None:
    url = unischema(tmp_path)
    write_table(tmp_path / "ds" / "part-00009.parquet", [2])
    with pytest.raises(DatasetError, match="missing from the row-group counts"):
        read_row_groups(url)


@pytest.mark.timeout(30)
def test_metadata_without_file_paths(tmp_path: Path) -> None:
    url = plain(tmp_path)
    footer = pq.read_metadata(tmp_path / "ds" / "part-00000.parquet")
    pq.write_metadata(
        footer.schema.to_arrow_schema(), tmp_path / "ds" / "_metadata", metadata_collector=[footer]
    )
    with pytest.raises(DatasetError, match="set_file_path"):
        read_row_groups(url)


@pytest.mark.timeout(30)
def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    with pytest.raises(DatasetError, match="no Parquet data files"):
        read_row_groups(tmp_path / "ds")


@pytest.mark.timeout(30)
def test_a_url_scheme_no_filesystem_knows() -> None:
    # Remote URLs are read since 0.2 (tests/test_remote_storage.py); an unknown scheme is not.
    with pytest.raises(DatasetError, match="no filesystem knows foo://"):
        read_row_groups("foo://bucket/dataset")


@pytest.mark.timeout(30)
def test_list_with_a_directory(tmp_path: Path) -> None:
    plain(tmp_path)
    with pytest.raises(DatasetError, match="is not a file"):
        read_row_groups([str(tmp_path / "ds"), str(tmp_path / "ds" / "part-00000.parquet")])


@pytest.mark.timeout(30)
def test_empty_list() -> None:
    with pytest.raises(DatasetError, match="empty"):
        read_row_groups([])


@pytest.mark.timeout(30)
def test_url_is_not_unquoted_like_petastorm(tmp_path: Path) -> None:
    # petastorm uses the URL path as is; a percent-encoded name is a different, missing path.
    root = tmp_path / "a=1"
    write_table(root / "x.parquet", [2])
    assert len(read_row_groups(f"file://{root}")) == 1
    with pytest.raises(DatasetError, match="does not exist"):
        read_row_groups(root.as_uri())


@pytest.mark.petastorm
@pytest.mark.timeout(30)
def test_row_group_counts_json_is_what_unischema_helper_wrote(tmp_path: Path) -> None:
    url = unischema(tmp_path)
    common = pq.read_metadata(tmp_path / "ds" / "_common_metadata")
    counts = json.loads(common.metadata[ROW_GROUPS_PER_FILE_KEY])
    groups = read_row_groups(url)
    assert sum(counts.values()) == len(groups)
    assert sorted(os.path.relpath(path, tmp_path / "ds") for path in groups.files) == sorted(counts)
