"""Planned rows read with pyarrow alone: every guarantee of ``EvenLoader.from_parquet`` on
today's numpy and pyarrow, without petastorm (``from_parquet(..., engine="arrow")``, and the
default where petastorm is not installed).

* ``passes.py``: the options it takes (and those only petastorm has, refused with the reason),
  the plan through :mod:`ddp_even.parquet.dataset_plan`, and the factory of a rank's passes;
* ``reader.py``: one pass: row groups read ahead in a thread into a bounded queue, the
  predicate applied, rows shuffled and cut as the plan says, batches handed out;
* ``columns.py``: a row group's columns as torch tensors, and batches as views of them.
"""
