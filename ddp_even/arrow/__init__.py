"""Planned rows read with pyarrow: ``EvenLoader.from_parquet``'s one reader, on every stack
(petastorm's codecs decode on top of it where a dataset needs them, :mod:`ddp_even.petastorm.
decoding`). Its modules are listed with the others in docs/design.md."""
