"""The row groups of a Parquet dataset, numbered exactly as petastorm 0.12.1 numbers them.

Petastorm shards, and this package plans, by *global row-group index*: the position of a row
group in the list petastorm builds when it opens a dataset. :class:`RowGroups` is that list
(files, rows per row group, footer digests); :mod:`ddp_even.parquet.metadata` reads it from
the dataset's Parquet metadata, without petastorm and without reading any data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Progress", "RowGroups"]

#: Where the row-group list came from.
MetadataSource = Literal["footers", "_metadata", "_common_metadata"]

#: Called as metadata files are read: ``progress(files_read, files_to_read)``.
Progress = Callable[[int, int], None]

# The key petastorm's materialize_dataset writes into _common_metadata
# (petastorm.etl.dataset_metadata.ROW_GROUPS_PER_FILE_KEY); copied so that planning does not
# import petastorm. tests/test_plan.py checks that the two agree.
ROW_GROUPS_PER_FILE_KEY = b"dataset-toolkit.num_row_groups_per_file.v1"


@dataclass(frozen=True, eq=False)
class RowGroups:
    """All row groups of a dataset in petastorm's global order, as read-only numpy columns.

    Row group ``i`` lives in ``files[file_of[i]]`` at position ``index_in_file[i]`` and has
    ``num_rows[i]`` rows. Columns rather than objects keep 100,000 row groups cheap to plan.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> from ddp_even.parquet import read_row_groups
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
        >>> groups = read_row_groups(root)
        >>> len(groups), groups.total_rows, groups.num_rows.tolist(), groups.index_in_file.tolist()
        (3, 10, [4, 4, 2], [0, 1, 2])
    """

    #: Data files holding at least one listed row group, in the order their row groups appear,
    #: on the dataset's filesystem: absolute on the local disk, ``bucket/key`` on object stores
    #: (the names petastorm gives them too).
    files: tuple[str, ...]
    #: Per row group: index into ``files``.
    file_of: npt.NDArray[np.int64]
    #: Per row group: position in its file.
    index_in_file: npt.NDArray[np.int64]
    #: Per row group: number of rows.
    num_rows: npt.NDArray[np.int64]
    #: Where the list came from.
    source: MetadataSource = "footers"
    #: Per file: a digest of its footer, when the list was read from the footers (None when
    #: it came from a ``_metadata`` summary). A file rewritten in place gets another footer.
    footer_digests: tuple[bytes, ...] | None = None
    #: With a ``_metadata`` summary: its digest (no footer is read then).
    summary_digest: bytes | None = None
    #: Per file of a listed directory: its size and modification time, from the listing. A
    #: pass reads again only the footers of files whose stamp changed; with a summary they
    #: name the files' content.
    file_stamps: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for column in (self.file_of, self.index_in_file, self.num_rows):
            column.setflags(write=False)

    def __len__(self) -> int:
        return len(self.num_rows)

    def path_of(self, index: int) -> str:
        """The file holding row group ``index``."""
        return self.files[int(self.file_of[index])]

    def identity(self) -> bytes:
        """What the list says of the data: files, row groups, rows and footer digests (a plan
        of another dataset, or of this one rewritten, has another)."""
        return b"|".join(
            (
                "\n".join(self.files).encode(),
                self.file_of.tobytes(),
                self.index_in_file.tobytes(),
                self.num_rows.tobytes(),
                b"".join(self.footer_digests or ()),
                self.summary_digest or b"",
                # Without footers (a summary), the files' sizes and times name their content.
                b"" if self.footer_digests else "\n".join(self.file_stamps or ()).encode(),
            )
        )

    @property
    def total_rows(self) -> int:
        """Rows in the whole dataset."""
        return int(self.num_rows.sum())
