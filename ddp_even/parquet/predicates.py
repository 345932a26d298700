"""What a row predicate is, which columns it reads, and the rows it keeps of a table.

Two kinds are understood:

* a ``pyarrow.compute.Expression`` (``pc.field("label") == 1``), evaluated by pyarrow on the
  row group's columns (no pandas, no petastorm);
* a petastorm-style predicate (``petastorm.predicates.in_lambda``, ``in_set``, ..., or any
  object with ``get_fields()`` and ``do_include(values)``), called as petastorm's
  ``make_batch_reader`` calls it: with a pandas ``DataFrame`` of the row group's predicate
  columns, returning a pandas ``Series`` of booleans.

:func:`kept_mask` is what both the count before planning (:mod:`ddp_even.parquet.
predicate_counts`) and the pyarrow reader (:mod:`ddp_even.arrow`) apply, so what was counted is
what is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from ddp_even.parquet.partitions import PartitionKeys
    from ddp_even.planning.row_groups import RowGroups
    from ddp_even.storage import ResolvedDataset

__all__ = [
    "check_predicate",
    "check_predicate_fields",
    "dataset_schema",
    "is_expression",
    "kept_mask",
    "predicate_fields",
]


def is_expression(predicate: Any) -> bool:
    """Whether ``predicate`` is a pyarrow expression (else a petastorm-style predicate)."""
    return isinstance(predicate, pc.Expression)


def predicate_fields(predicate: Any, schema: pa.Schema) -> list[str]:
    """The columns ``predicate`` reads, in ``schema``'s order.

    An expression's fields are read from the expression itself (its serialized form lists
    each field reference by name). A positional reference (``pc.field(1)``) means column 1 of
    the table it is evaluated on, so the columns before it are kept too: evaluated on the
    columns returned here, in this order, it sees the column it names in ``schema``. Names
    ``schema`` lacks are kept (last) for the caller to name; an expression whose fields cannot
    be told reads every column, which is slower, never wrong.

    Example:
        >>> schema = pa.schema([("id", pa.int64()), ("label", pa.int64()), ("x", pa.float32())])
        >>> predicate_fields(pc.field("label") == 1, schema)
        ['label']
        >>> predicate_fields(pc.field(1) == 1, schema)  # column 1: label, read where it is
        ['id', 'label']
        >>> predicate_fields(pc.field("lable") == 1, schema)  # the caller names what is missing
        ['lable']
    """
    if not is_expression(predicate):
        return sorted(predicate.get_fields())
    names = _referenced_names(predicate)
    if names is None:  # positional references
        return _positional_fields(predicate, schema)
    known = [name for name in schema.names if name in names]
    unknown = [name for name in dict.fromkeys(names) if name not in schema.names]
    if unknown or _binds(predicate, schema, known):
        return [*known, *unknown]
    return list(schema.names)


def _positional_fields(predicate: pc.Expression, schema: pa.Schema) -> list[str]:
    """The columns up to the last position ``predicate`` refers to, if it evaluates on those
    alone (a name it also refers to may lie further): else every column."""
    # str() prints a positional reference as FieldPath(i j ...): i is the top-level column.
    positions = [int(found) for found in re.findall(r"FieldPath\((\d+)", str(predicate))]
    last = max(positions, default=len(schema) - 1)
    prefix = list(schema.names[: last + 1])
    return prefix if _binds(predicate, schema, prefix) else list(schema.names)


def _binds(predicate: pc.Expression, schema: pa.Schema, names: list[str]) -> bool:
    """Whether ``predicate`` evaluates on ``schema``'s columns ``names`` alone, in its order."""
    try:
        kept_mask(predicate, schema.empty_table().select(names))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError):
        return False
    return True


def _referenced_names(predicate: pc.Expression) -> list[str] | None:
    """The top-level column of each field reference in ``predicate``, by name; None when it
    has a positional one (which pyarrow does not serialize).

    pyarrow has no public list of an expression's fields, but serializes it (to pickle it) as
    an Arrow IPC file whose schema metadata walks the expression: ``field_ref`` for a named
    reference, ``nested_field_ref: k`` before the ``k`` parts of a nested one (``pc.field("s",
    "x")``), whose first part is the column. The keys repeat, so they are read in order from
    the printed schema (``Schema.metadata`` keeps one value per key).
    """
    import pyarrow.ipc

    try:
        serialized = predicate.__reduce__()[1][0]
    except pa.ArrowNotImplementedError:  # "Serialization of non-name field_refs"
        return None
    pairs = iter(_metadata_pairs(pyarrow.ipc.open_file(serialized).schema))
    names = []
    for key, value in pairs:
        if key in ("field_ref", "nested_field_ref"):
            names.append(_reference_path(pairs, key, value)[0])
    return names


def _reference_path(pairs: Iterator[tuple[str, str]], key: str, value: str) -> list[str]:
    """The names of one field reference that starts with ``key: value``, its parts read on."""
    if key == "field_ref":
        return [value]
    path: list[str] = []
    for _ in range(int(value)):
        path.extend(_reference_path(pairs, *next(pairs)))
    return path


# Where a pair of a serialized expression starts in its printed metadata: one of the keys
# pyarrow writes (arrow/compute/expression.cc), so a name with a newline stays whole.
_PAIR_START = re.compile(r"\n(?=(?:call|end|field_ref|literal|nested_field_ref|options): ')")


def _metadata_pairs(schema: pa.Schema) -> list[tuple[str, str]]:
    """A serialized expression's schema metadata as its key-value pairs, in order, repeated
    keys included: pyarrow prints each pair as ``key: 'value'``, unescaped and whole."""
    printed = schema.to_string(truncate_metadata=False, show_field_metadata=False)
    section = printed.partition("-- schema metadata --\n")[2]
    pairs = [pair.partition(": '") for pair in _PAIR_START.split(section)] if section else []
    return [(key, value.removesuffix("'")) for key, _, value in pairs]


def kept_mask(predicate: Any, table: pa.Table) -> npt.NDArray[np.bool_]:
    """Which rows of ``table`` (a row group's predicate columns) ``predicate`` keeps.

    Example:
        >>> kept_mask(pc.field("id") > 1, pa.table({"id": [0, 1, 2, 3]})).tolist()
        [False, False, True, True]
    """
    if is_expression(predicate):
        import pyarrow.dataset as ds

        kept = ds.dataset(table).to_table(columns={"kept": predicate})["kept"]
        # A null (a comparison with a missing value) keeps nothing, as a filter would.
        return np.asarray(kept.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
    kept = predicate.do_include(table.to_pandas())
    check_mask(kept)
    return np.asarray(kept, dtype=bool)


def check_mask(kept: Any) -> None:
    """``TypeError`` unless a petastorm-style predicate returned a pandas ``Series``."""
    import pandas as pd  # type: ignore[import-untyped]  # installed with petastorm

    if not isinstance(kept, pd.Series):
        # Petastorm's make_batch_reader worker calls .map on it: fail here, on every rank.
        raise TypeError(
            f"the predicate returned a {type(kept).__name__}; make_batch_reader needs a pandas "
            "Series of booleans from it: compute on the Series it is given (ids % 2 == 0), "
            "not on numpy arrays"
        )


def check_predicate_fields(
    predicate: Any, resolved: ResolvedDataset, row_groups: RowGroups, partitions: PartitionKeys
) -> list[str]:
    """The predicate's fields (stored columns and hive partition keys); a ``ValueError``
    naming those the dataset does not have.

    Every rank reads the same footer, so every rank raises the same error.
    """
    schema = dataset_schema(resolved, row_groups, partitions)
    fields = predicate_fields(predicate, schema)
    if not fields:
        raise ValueError("the predicate names no fields: its get_fields() must return some")
    missing = [field for field in fields if field not in schema.names]
    if missing:
        raise ValueError(
            f"the predicate reads field(s) {', '.join(missing)}, which {resolved.describe()} "
            f"does not have; its columns are: {', '.join(sorted(schema.names))}"
        )
    return fields


def check_predicate(predicate: Any) -> None:
    """A ``TypeError`` unless ``predicate`` is one of the two kinds understood."""
    if not is_expression(predicate) and not (
        hasattr(predicate, "get_fields") and hasattr(predicate, "do_include")
    ):
        raise TypeError(
            "predicate must be a pyarrow expression (pyarrow.compute.field('label') == 1) or a "
            "petastorm predicate (petastorm.predicates.in_lambda, in_set, ...), got "
            f"{type(predicate).__name__}"
        )


def dataset_schema(
    resolved: ResolvedDataset, row_groups: RowGroups, partitions: PartitionKeys
) -> pa.Schema:
    """The columns of the dataset's first file and its hive partition keys."""
    stored = resolved.storage.read_footer(row_groups.files[0]).schema.to_arrow_schema()
    return pa.unify_schemas([stored, partitions.schema])
