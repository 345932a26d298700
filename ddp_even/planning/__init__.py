"""Planning before training: a dataset's row groups, and who reads which of them.

Pure arithmetic over row-group sizes, except :func:`read_row_groups` (and
:func:`plan_for_dataset`), which read Parquet metadata through :mod:`ddp_even.storage`. Nothing
here imports petastorm; the readers that follow a plan are in :mod:`ddp_even.petastorm.readers`.
The names users need::

    from ddp_even.planning import plan_for_dataset, plan_shards, ShardPlan
"""

from ddp_even.errors import DatasetError
from ddp_even.planning.metadata import read_row_groups
from ddp_even.planning.mode_stats import ModeStats
from ddp_even.planning.plans import ShardPlan, plan_for_dataset, plan_shards
from ddp_even.planning.row_groups import RowGroups

__all__ = [
    "DatasetError",
    "ModeStats",
    "RowGroups",
    "ShardPlan",
    "plan_for_dataset",
    "plan_shards",
    "read_row_groups",
]
