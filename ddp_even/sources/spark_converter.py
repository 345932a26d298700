"""Where 0.2 kept :class:`ConverterSource`: it lives in :mod:`ddp_even.petastorm.spark_converter`
now (petastorm has one home); these names stay importable from here for code written for 0.2.

Example::

    >>> from ddp_even.sources.spark_converter import ConverterSource
    >>> ConverterSource.__module__
    'ddp_even.petastorm.spark_converter'
"""

from ddp_even.petastorm.spark_converter import ConverterSource, converter_files

__all__ = ["ConverterSource", "converter_files"]
