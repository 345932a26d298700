"""The one error planning raises for a dataset it cannot plan: :class:`DatasetError`."""

from __future__ import annotations

__all__ = ["DatasetError"]


class DatasetError(ValueError):
    """The dataset cannot be planned: missing, unreachable, not Parquet, or laid out so petastorm
    fails too.

    The message is one line: it names the path or URL and says what to do.

    Example:
        >>> from ddp_even.planning.datasets import read_row_groups
        >>> try:
        ...     read_row_groups("/no/such/dataset")
        ... except DatasetError as error:
        ...     print(error)
        /no/such/dataset does not exist: check the path or URL
    """
