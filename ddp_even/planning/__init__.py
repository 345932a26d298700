"""Planning before training: a dataset's row groups, shard plans, balanced shards, readers.

Listing row groups and planning need pyarrow only; petastorm is imported only by
``readers.py``, when a reader is built. The names users need::

    from ddp_even.planning import plan_for_dataset, plan_shards, ShardPlan
"""

from ddp_even.planning.datasets import DatasetError, RowGroups, read_row_groups
from ddp_even.planning.plans import ModeStats, ShardPlan, plan_for_dataset, plan_shards

__all__ = [
    "DatasetError",
    "ModeStats",
    "RowGroups",
    "ShardPlan",
    "plan_for_dataset",
    "plan_shards",
    "read_row_groups",
]
