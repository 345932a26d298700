"""A resumed epoch says where it resumes once for the job, on rank 0.

After a resume every rank logged "epoch 0 resumes after step 2: read 0 batch(es) of this rank's
source again to get there" (and "this rank reads only its N rows not yet read") at INFO: the
same line once per rank. Now rank 0 logs them at INFO, every other rank at DEBUG only.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ddp_even import EvenLoader
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.logs import ddp_even_messages
from tests.helpers.spawn import run_ranks

SIZES = [[10, 7], [12, 9], [8], [11]]
IN_ORDER = {"shuffle_row_groups": False}
AGAIN = "batch(es) of this rank's source again"
TAILS = "this rank reads only its"


def _resume(rank: int, world_size: int, url: str) -> dict[str, list[str]]:
    def loader() -> EvenLoader[Any]:
        return EvenLoader.from_parquet(url, 4, "truncate", reader_kwargs=IN_ORDER)

    first = loader()
    epoch = iter(first)
    next(epoch), next(epoch)
    state = first.state_dict()
    del epoch
    info = ddp_even_messages(logging.INFO)
    debug = ddp_even_messages(logging.DEBUG)
    resumed = loader()
    resumed.load_state_dict(state)
    list(resumed)
    return {"info": list(info), "debug": list(debug)}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_where_a_resumed_epoch_starts_is_said_once_on_rank_0(tmp_path: Any) -> None:
    url = write_plain_dataset(tmp_path / "ds", SIZES)
    ranks = run_ranks(_resume, 2, url, timeout=100)
    for words in (AGAIN, TAILS):
        assert sum(words in message for message in ranks[0]["info"]) == 1, words
        assert not any(words in message for message in ranks[1]["info"]), words
        assert sum(words in message for message in ranks[1]["debug"]) == 1, "rank 1's own, kept"
