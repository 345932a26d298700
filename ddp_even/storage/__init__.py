"""Where a dataset lives: a URL (or path, or list of files) resolved to the storage that lists
and reads it. ``resolve.py`` holds the registry of schemes, ``backends.py`` the local and
``pyarrow.fs`` storages and how their failures are explained, ``filesystems.py`` how each
filesystem is built from options and the environment, ``locations.py`` the parts of a URL.

Example:
    >>> from ddp_even.storage import resolve_dataset
    >>> resolve_dataset("/data/train").storage.is_local
    True
"""

from ddp_even.storage.backends import Storage
from ddp_even.storage.locations import DatasetLocation
from ddp_even.storage.resolve import ResolvedDataset, StorageOptions, resolve_dataset

__all__ = ["DatasetLocation", "ResolvedDataset", "Storage", "StorageOptions", "resolve_dataset"]
