"""Planned rows read with pyarrow: ``EvenLoader.from_parquet``'s one reader, on every stack
(petastorm's codecs decode on top of it where a dataset needs them, :mod:`ddp_even.petastorm.
decoding`).

* ``passes.py``: the options it takes (and those only petastorm has, refused with the reason),
  the plan through :mod:`ddp_even.parquet.dataset_plan`, and the factory of a rank's passes;
* ``reader.py``: one pass: row groups read ahead in a thread into a bounded queue, the
  predicate applied, rows shuffled and cut as the plan says, batches handed out;
* ``columns.py``: a row group's columns as torch tensors, and batches as views of them.
"""
