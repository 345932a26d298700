"""Planning before training: who reads which row groups, in what order, for how many steps.

Pure arithmetic over row-group sizes (:class:`RowGroups`): nothing here reads storage or
imports petastorm or torch. Reading a dataset's row groups from its Parquet metadata is
:mod:`ddp_even.parquet`'s; the reader that follows a plan is :mod:`ddp_even.arrow`'s.
The names users need::

    from ddp_even.planning import plan_shards, ShardPlan
    from ddp_even.parquet import plan_for_dataset, read_row_groups
"""

from ddp_even.planning.plans import ShardPlan, plan_shards

__all__ = ["ShardPlan", "plan_shards"]
