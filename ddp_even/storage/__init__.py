"""Where a dataset lives: a URL, path or list of files resolved to the storage that reads it.

Example:
    >>> from ddp_even.storage import resolve_dataset
    >>> resolve_dataset(["/data/a.parquet", "/data/b.parquet"]).describe()
    '2 files from /data/a.parquet'
"""

from ddp_even.storage.backends import Storage
from ddp_even.storage.resolve import (
    DatasetLocation,
    ResolvedDataset,
    StorageOptions,
    resolve_dataset,
)

__all__ = ["DatasetLocation", "ResolvedDataset", "Storage", "StorageOptions", "resolve_dataset"]
