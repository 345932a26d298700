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

import ctypes
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
    "x")``), whose first part is the column. The keys repeat, so they are read in order through
    the Arrow C data interface (``Schema.metadata`` keeps one value per key).
    """
    import pyarrow.ipc

    try:
        serialized = predicate.__reduce__()[1][0]
    except pa.ArrowNotImplementedError:  # "Serialization of non-name field_refs"
        return None
    pairs = iter(_metadata_pairs(pyarrow.ipc.open_file(serialized).schema))
    names = []
    for key, value in pairs:
        if key in (b"field_ref", b"nested_field_ref"):
            names.append(_reference_path(pairs, key, value)[0])
    return names


def _reference_path(pairs: Iterator[tuple[bytes, bytes]], key: bytes, value: bytes) -> list[str]:
    """The names of one field reference that starts with ``key: value``, its parts read on."""
    if key == b"field_ref":
        return [value.decode()]
    path: list[str] = []
    for _ in range(int(value)):
        path.extend(_reference_path(pairs, *next(pairs)))
    return path


class _ArrowSchema(ctypes.Structure):
    """The Arrow C data interface's ``struct ArrowSchema`` (a stable ABI)."""

    _fields_ = [  # ctypes reads this class attribute
        ("format", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("metadata", ctypes.c_void_p),
        ("flags", ctypes.c_int64),
        ("n_children", ctypes.c_int64),
        ("children", ctypes.c_void_p),
        ("dictionary", ctypes.c_void_p),
        ("release", ctypes.c_void_p),
        ("private_data", ctypes.c_void_p),
    ]


_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _metadata_pairs(schema: pa.Schema) -> list[tuple[bytes, bytes]]:
    """``schema``'s metadata as its key-value pairs, in order, repeated keys included.

    The C data interface encodes them as an int32 count, then each key and value as an int32
    length and its bytes; the capsule releases the exported schema when it is collected.
    """
    capsule = schema.__arrow_c_schema__()
    exported = _ArrowSchema.from_address(_capsule_pointer(capsule, b"arrow_schema"))
    address = exported.metadata
    if not address:
        return []

    def read_int32() -> int:
        nonlocal address
        value = int(ctypes.c_int32.from_address(address).value)
        address += 4
        return value

    def read_bytes() -> bytes:
        nonlocal address
        length = read_int32()
        value = ctypes.string_at(address, length)
        address += length
        return value

    return [(read_bytes(), read_bytes()) for _ in range(read_int32())]


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
    check_predicate(predicate)
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
