"""Ray Train (``TorchTrainer``, 2 CPU workers over gloo) with Ray Data: the recipe of
docs/stacks.md, in the lane of today's stack (``recipes`` extra; skipped where Ray is missing).

Each worker reads its own unequal Parquet files through Ray Data, wrapped in an EvenLoader in
pad mode; then ``EvenLoader.from_parquet`` inside the train loop. The train loops
(tests/helpers/ray_train_loop.py) write what each worker trained; the test checks equal steps,
every row once, each worker's rows against its files, and equal replicas.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.stacks import Seen, assert_documented, need, write_id_files

ray = need("ray")
need("ray.train.torch")

# One process runs the module (scripts/test.sh: -n 3 --dist loadgroup): its job starts once.
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("stack-ray")]

REPO = Path(__file__).resolve().parent.parent
WORKERS = 2
BATCH_SIZE = 16
# One row group per file. Worker r reads files r, r + 2, r + 4: 600 rows (38 batches of 16)
# and 80 rows (5 batches).
FILE_SIZES = (300, 40, 200, 20, 100, 20)
TOTAL_ROWS = sum(FILE_SIZES)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local Ray of 4 CPUs (2 workers, and Ray Data's read tasks beside them); the folder
    where the runs write."""
    workdir = tmp_path_factory.mktemp("ray")
    # The workers import tests.helpers.ray_train_loop; Ray's token check and its usage
    # report are off (a local cluster, no network). Ray Train gives its workers 60 s to
    # start; beside the other tests on 2 busy cores, they get longer.
    environment = {
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "disabled",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
    }
    # Ray's session keeps its sockets there: a short path (at most 107 bytes for a socket).
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            runtime_env={"env_vars": environment},
            _temp_dir=temp_dir,
        )
        try:
            yield workdir
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _fit(loop: Any, config: dict[str, Any], workdir: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(workdir / "storage"), name=loop.__name__),
    )
    trainer.fit()


def _read(results: Path, name: str) -> list[dict[str, Any]]:
    return [
        json.loads((results / f"{name}-rank{rank}.json").read_text()) for rank in range(WORKERS)
    ]


def _real_rows(result: dict[str, Any]) -> list[int]:
    return sorted(Seen(result["ids"], result["padding"]).real_rows())


def _file_rows(indices: range) -> list[int]:
    starts = [sum(FILE_SIZES[:index]) for index in range(len(FILE_SIZES))]
    return sorted(
        row for index in indices for row in range(starts[index], starts[index] + FILE_SIZES[index])
    )


@pytest.fixture(scope="module")
def results(cluster: Path) -> Path:
    """One fit, both loops: what each worker wrote."""
    from tests.helpers.ray_train_loop import both_loops

    files = write_id_files(cluster / "data", FILE_SIZES)
    results = cluster / "results"
    results.mkdir()
    config = {
        "files": files,
        "data": str(cluster / "data"),
        "batch_size": BATCH_SIZE,
        "results": str(results),
    }
    _fit(both_loops, config, cluster)
    return results


@pytest.mark.timeout(240)
def test_ray_data_per_worker_files_in_pad_mode_train_every_row_once(results: Path) -> None:
    ranks = _read(results, "ray-data")
    batches = [
        math.ceil(len(_file_rows(range(rank, len(FILE_SIZES), WORKERS))) / BATCH_SIZE)
        for rank in range(WORKERS)
    ]
    assert batches == [38, 5]
    for rank, result in enumerate(ranks):
        assert len(result["ids"]) == max(batches)
        assert _real_rows(result) == _file_rows(range(rank, len(FILE_SIZES), WORKERS))
        assert result["padding"] == [False] * batches[rank] + [True] * (
            max(batches) - batches[rank]
        )
    assert sorted(_real_rows(ranks[0]) + _real_rows(ranks[1])) == list(range(TOTAL_ROWS))
    # DDP (prepare_model) kept the replicas equal through the padding steps.
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.timeout(240)
def test_from_parquet_inside_the_train_loop_trains_every_row_once(results: Path) -> None:
    ranks = _read(results, "from-parquet")
    steps = len(ranks[0]["ids"])
    for rank, result in enumerate(ranks):
        # The plan knows the steps before the first one, on every worker.
        assert len(result["ids"]) == result["length"] == steps
        # The default sharding, round robin over the row groups: one per file here.
        assert _real_rows(result) == _file_rows(range(rank, len(FILE_SIZES), WORKERS))
    assert sorted(_real_rows(ranks[0]) + _real_rows(ranks[1])) == list(range(TOTAL_ROWS))
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_docs_show_this_recipe() -> None:
    assert_documented(
        "Ray Train with Ray Data",
        [REPO / "tests" / "helpers" / "ray_train_loop.py", Path(__file__)],
    )
