"""What a Parquet dataset holds, read from its storage: row groups from the files' footers (no
data), whether they changed, how a dataset directory is laid out, and how many rows a row
predicate keeps in each row group (counted once, cached). Storage is :mod:`ddp_even.storage`'s;
what is done with the counts is :mod:`ddp_even.planning`'s.
"""

from ddp_even.errors import DatasetError
from ddp_even.parquet.dataset_plan import plan_for_dataset
from ddp_even.parquet.metadata import read_row_groups

__all__ = ["DatasetError", "plan_for_dataset", "read_row_groups"]
