"""Everything that knows petastorm: the only package of ddp_even that imports it (its
modules, one job each, are listed with the others in docs/design.md).

Nothing here is imported by ``import ddp_even``: the sources register by class name
(:mod:`ddp_even.sources.base`) and the rest is imported when used.

Once it is, petastorm's own warnings about the pinned stack are ignored (the two filters
below): petastorm 0.12.1 calls pyarrow APIs that pyarrow 14 deprecates (a dozen
``FutureWarning`` lines per reader, per rank) and hands torch read-only numpy arrays (torch's
"not writable" warning); neither is anything a user of these pins can act on. Only warnings
raised from petastorm's modules are ignored.

Private petastorm 0.12.1 attributes relied on (pinned in ``constraints.txt``), each with why;
``tests/test_petastorm_contract.py`` checks every one of them against the installed petastorm
and fails first, naming the attribute, if a release changes it:

* ``Reader._workers_pool``: its pool is made race-free (``pools.py``), its worker shows a
  ``transform_spec`` (``reading.py``);
* ``Reader.ventilator._items_to_ventilate`` (a list of dicts with ``piece_index``,
  ``worker_predicate`` and ``shuffle_row_drop_partition``) and ``._randomize_item_order``:
  which row groups a reader reads, and how (``reading.py``);
* ``ThreadPool._workers[i]._worker_impl``, ``DummyPool._worker`` and the worker's
  ``_transform_spec``: whether a ``transform_spec`` may drop rows (``reading.py``); the
  workers' ``args`` 4, 6, 8, 9 and 10 (the dataset's row groups, ``transform_spec``,
  ``filters``, ``shuffle_rows``, ``seed``): what a reader was built from (``reading.py``);
  ``Reader.is_batched_reader``, ``Reader.dataset._partitions`` and ``._common_metadata``
  likewise;
* ``ThreadPool.get_results`` and its ``_ventilator``, ``_results_queue``, ``_ventilated_items``,
  ``_ventilated_items_processed`` and ``thread_pool._VERIFY_END_OF_VENTILATION_PERIOD``;
  ``ProcessPool.get_results`` and its ``_results_receiver_poller``, ``_results_receiver``,
  ``_serializer``, ``_zmq_copy_buffers``; ``DummyPool.get_results`` and its
  ``_ventilator_queue``: the race-free ``get_results`` (``pools.py``);
* ``LoaderBase._batch_acc``: ``DataLoader``'s rows left over from the last pass, emptied before
  each pass (``sources.py``);
* ``Reader.dataset.paths`` and ``Reader.dataset._fs`` (pyarrow 14's legacy ``ParquetDataset``;
  its public ``fs`` warns that it is deprecated): the files a reader reads and whether they are
  local (``reading.py``).
"""

import warnings

warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm\.")
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", module=r"petastorm\."
)
