"""Where a dataset lives: a URL, path or list of files resolved to the storage that reads it.

Example:
    >>> from ddp_even.storage import resolve_dataset
    >>> resolve_dataset("file:///data/train/").paths
    ('/data/train',)
"""

from ddp_even.storage.backends import Storage
from ddp_even.storage.resolve import (
    DatasetLocation,
    ResolvedDataset,
    StorageOptions,
    resolve_dataset,
)

__all__ = ["DatasetLocation", "ResolvedDataset", "Storage", "StorageOptions", "resolve_dataset"]
