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

import posixpath
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from ddp_even.planning.row_groups import RowGroups
    from ddp_even.storage import ResolvedDataset

__all__ = ["check_predicate_fields", "is_expression", "kept_mask", "predicate_fields"]


def is_expression(predicate: Any) -> bool:
    """Whether ``predicate`` is a pyarrow expression (else a petastorm-style predicate)."""
    return isinstance(predicate, pc.Expression)


def predicate_fields(predicate: Any, schema: pa.Schema) -> list[str]:
    """The columns ``predicate`` reads, in ``schema``'s order.

    An expression does not list its fields (pyarrow has no public way to): the columns whose
    names its text mentions are taken, and if it cannot be evaluated on those alone, all.

    Example:
        >>> schema = pa.schema([("id", pa.int64()), ("label", pa.int64()), ("x", pa.float32())])
        >>> predicate_fields(pc.field("label") == 1, schema)
        ['label']
        >>> predicate_fields(pc.field("lable") == 1, schema)  # the caller names what is missing
        ['lable']
    """
    if not is_expression(predicate):
        return sorted(predicate.get_fields())
    text = str(predicate)
    mentioned = [name for name in schema.names if name in text]
    try:
        kept_mask(predicate, schema.empty_table().select(mentioned))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as error:
        # A field the schema lacks: named, so that the caller's check says which is missing.
        unknown = [
            name
            for name in re.findall(r"FieldRef\.Name\(([^)]*)\)", str(error))
            if name not in schema.names
        ]
        return [*mentioned, *unknown] if unknown else list(schema.names)
    return mentioned


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
    predicate: Any, resolved: ResolvedDataset, row_groups: RowGroups
) -> tuple[list[str], bool]:
    """The predicate's fields, and whether all are stored columns (none a hive partition key);
    a ``ValueError`` naming those the dataset does not have.

    Every rank reads the same footer, so every rank raises the same error.
    """
    if not is_expression(predicate) and not (
        hasattr(predicate, "get_fields") and hasattr(predicate, "do_include")
    ):
        raise TypeError(
            "predicate must be a pyarrow expression (pyarrow.compute.field('label') == 1) or a "
            "petastorm predicate (petastorm.predicates.in_lambda, in_set, ...), got "
            f"{type(predicate).__name__}"
        )
    first_file = row_groups.files[0]
    schema = resolved.storage.read_footer(first_file).schema.to_arrow_schema()
    fields = predicate_fields(predicate, schema)
    if not fields:
        raise ValueError("the predicate names no fields: its get_fields() must return some")
    columns = set(schema.names)
    partitions = {
        part.split("=", 1)[0] for part in posixpath.dirname(first_file).split("/") if "=" in part
    }
    missing = [field for field in fields if field not in columns | partitions]
    if missing:
        raise ValueError(
            f"the predicate reads field(s) {', '.join(missing)}, which {resolved.describe()} "
            f"does not have; its columns are: {', '.join(sorted(columns | partitions))}"
        )
    return fields, set(fields) <= columns
