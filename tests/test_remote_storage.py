"""Remote datasets, through the real client stack: pyarrow's S3 client against a local S3 server,
and pyarrow's GCS client against a local GCS emulator.

A moto server (tests/helpers/s3_server.py) holds the same skewed datasets the local tests use,
in the layouts petastorm reads (plain, hive partitions, a ``_metadata`` summary, a Unischema
with ``_common_metadata``). The plans must be petastorm's own sharding of the same S3 data, the
requests the server counts must stay within budget, the CLI must reach the server through the
environment and ``--storage-option``, four gloo ranks must train from ``s3://`` in every mode,
and every bad input must give one line that says what to check. ``gs://`` is read from
``gcp-storage-emulator`` (tests/helpers/gcs_server.py): planned, read by both readers, and
trained from on four ranks in every mode. Schemes without a server here run through the same
code: fsspec's ``memory://`` and local filesystems passed as ``filesystem=``; ``hdfs://`` and
Azure only on their error paths (no Hadoop cluster or Azure emulator here).
"""

from __future__ import annotations

import importlib.util
import io
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from ddp_even.arrow.passes import make_shard_factory
from ddp_even.cli import main, tables
from ddp_even.errors import DatasetError
from ddp_even.parquet import plan_for_dataset
from ddp_even.parquet.metadata import read_row_groups
from ddp_even.planning.plans import ShardPlan
from ddp_even.storage import resolve_dataset
from tests.helpers.datasets import flat_sizes
from tests.helpers.gcs_server import GcsServer, metadata_server, start_gcs_server
from tests.helpers.s3_server import S3Server, free_port, upload_directory
from tests.helpers.shard_reads import Layouts, collect
from tests.helpers.spawn import run_ranks

# Skewed on purpose: round robin over 4 ranks gives rank 0 far more rows than rank 3.
SIZES = [[40, 3], [30, 5], [1, 6, 4, 2], [25, 2], [2, 2, 9, 3]]
LAYOUTS = ("plain", "partitioned", "with_metadata", "unischema")
WORLD_SIZE = 4
BATCH = 8
BUCKET = "ddp-even"


@pytest.fixture(scope="module")
def urls(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each layout of SIZES, written locally by the usual helpers and copied to the server."""
    root = tmp_path_factory.mktemp("remote")
    layouts = Layouts(SIZES)
    written = {}
    for layout in LAYOUTS:
        if layout == "unischema" and importlib.util.find_spec("petastorm") is None:
            continue  # its Unischema is petastorm's; the lane without petastorm skips its tests
        getattr(layouts, layout)(root / layout)
        written[layout] = upload_directory(s3, root / layout, f"{BUCKET}/{layout}")
    return written


def _ids_by_row_group() -> list[list[int]]:
    ids: list[list[int]] = []
    start = 0
    for size in flat_sizes(SIZES):
        ids.append(list(range(start, start + size)))
        start += size
    return ids


def _planned_ids(plan: ShardPlan, rank: int) -> list[int]:
    groups = _ids_by_row_group()
    return sorted(row for group in plan.shards[rank] for row in groups[group])


def _petastorm_round_robin(url: str, storage_options: dict[str, Any], rank: int, kind: str) -> Any:
    """Petastorm's own sharding (``cur_shard``/``shard_count``) of the S3 dataset.

    Through petastorm's ``Reader`` given the filesystem ddp_even builds: ``make_batch_reader``
    itself strips an ``s3://`` URL with s3fs, which these tests do not install.
    """
    from petastorm.arrow_reader_worker import ArrowReaderWorker
    from petastorm.py_dict_reader_worker import PyDictReaderWorker
    from petastorm.reader import Reader
    from petastorm.workers_pool.dummy_pool import DummyPool

    from ddp_even.petastorm.legacy_filesystem import ArrowLegacyFileSystem

    resolved = resolve_dataset(url, storage_options=storage_options)
    batched = kind != "unischema"
    with Reader(
        ArrowLegacyFileSystem(resolved.storage.filesystem),
        list(resolved.paths) if resolved.is_list else resolved.paths[0],
        worker_class=ArrowReaderWorker if batched else PyDictReaderWorker,
        is_batched_reader=batched,
        reader_pool=DummyPool(),
        num_epochs=1,
        cur_shard=rank,
        shard_count=WORLD_SIZE,
        shuffle_row_groups=False,
    ) as reader:
        return sorted(collect(reader).ids)


@pytest.mark.petastorm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_is_what_petastorm_reads_from_s3(
    s3: S3Server, urls: dict[str, str], layout: str
) -> None:
    row_groups, plan = plan_for_dataset(
        urls[layout], WORLD_SIZE, BATCH, storage_options=s3.storage_options()
    )
    assert row_groups.num_rows.tolist() == flat_sizes(SIZES)
    source = {"with_metadata": "_metadata", "unischema": "_common_metadata"}
    assert row_groups.source == source.get(layout, "footers")
    assert all(path.startswith(f"{BUCKET}/{layout}/") for path in row_groups.files)
    for rank in range(WORLD_SIZE):
        read = _petastorm_round_robin(urls[layout], s3.storage_options(), rank, layout)
        assert read == _planned_ids(plan, rank), f"rank {rank}"
        assert len(read) == plan.rows_per_rank[rank]


@pytest.mark.timeout(60)
def test_requests_stay_within_budget(s3: S3Server, urls: dict[str, str]) -> None:
    options = s3.storage_options()
    with s3.recording() as footers:
        groups = read_row_groups(urls["partitioned"], storage_options=options)
    data_files = set(groups.files)
    per_object = footers.reads_per_object()
    assert {path for path in per_object if path.endswith(".parquet")} == data_files
    assert all(per_object[path] <= 2 for path in data_files), per_object
    # One listing per directory level member: the root and each of the 5 partitions.
    assert footers.by_method()["LIST"] <= 1 + len(SIZES) + 1

    with s3.recording() as summary:
        read_row_groups(urls["with_metadata"], storage_options=options)
    reads = summary.reads_per_object()
    assert not [path for path in reads if path.endswith(".parquet")], "no footer is read"
    metadata = summary.to(f"{BUCKET}/with_metadata/_metadata")
    assert [request.method for request in metadata].count("GET") == 1, metadata


def _cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["plan", *args], env=env, catch_exceptions=False)


@pytest.mark.timeout(60)
def test_cli_reaches_s3_through_aws_endpoint_url(s3: S3Server, urls: dict[str, str]) -> None:
    result = _cli(
        urls["plain"], "-w", "4", "-b", "8", "--json", env={"AWS_ENDPOINT_URL": s3.endpoint}
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    _, plan = plan_for_dataset(urls["plain"], 4, 8, storage_options=s3.storage_options())
    assert document["plan"]["rows_per_rank"] == list(plan.rows_per_rank)
    assert document["num_files"] == len(SIZES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["endpoint_url", "client_kwargs.endpoint_url"])
def test_cli_storage_option(s3: S3Server, urls: dict[str, str], key: str) -> None:
    # A summary of row groups per file (_common_metadata; also petastorm's Unischema layout).
    result = _cli(
        urls["with_metadata"], "-w", "4", "-b", "8", "--sharding", "row_groups", "--storage-option",
        f"{key}={s3.endpoint}", "--storage-option", "connect_timeout=5",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"{len(flat_sizes(SIZES))} row groups, {len(SIZES)} files" in result.output
    assert "Round robin vs balanced row groups" in result.output


@pytest.mark.timeout(60)
def test_cli_bad_credentials_is_one_line(s3: S3Server, urls: dict[str, str]) -> None:
    env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = _cli(urls["plain"], "-w", "2", "-b", "8", env=env)
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and result.output.strip().count("\n") == 0
    assert "access denied (" in result.output
    assert "AWS_SECRET_ACCESS_KEY" in result.output


@pytest.mark.timeout(60)
def test_cli_bad_storage_option_is_a_usage_error(urls: dict[str, str]) -> None:
    result = _cli(urls["plain"], "-w", "2", "-b", "8", "--storage-option", "endpoint_url")
    assert result.exit_code == 2
    assert "is not KEY=VALUE" in result.output


@pytest.mark.timeout(30)
def test_progress_bar_appears_once_reading_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(tables, "_PROGRESS_AFTER_S", 0.0)
    console = Console(file=screen, force_terminal=True, width=100)
    with tables.metadata_progress(console) as progress:
        progress(3, 10)
        progress(10, 10)
    assert "reading Parquet metadata" in screen.getvalue()
    log_file = io.StringIO()
    with tables.metadata_progress(Console(file=log_file)) as progress:
        progress(3, 10)
    assert log_file.getvalue() == "", "no bar is drawn into a file or pipe"
    quiet = io.StringIO()
    monkeypatch.setattr(tables, "_PROGRESS_AFTER_S", 60.0)
    with tables.metadata_progress(Console(file=quiet, force_terminal=True)) as progress:
        progress(3, 10)
    assert quiet.getvalue() == ""


def _bad_credentials(s3: S3Server) -> dict[str, Any]:
    return {"endpoint_url": s3.endpoint, "key": s3.access_key, "secret": "wrong"}


def _unknown_key(s3: S3Server) -> dict[str, Any]:
    return {"endpoint_url": s3.endpoint, "key": "AKIANOSUCHKEY0000000", "secret": "x"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("dataset", "options", "words"),
    [
        ("s3://no-such-bucket/train", None, "bucket 'no-such-bucket' does not exist"),
        (f"s3://{BUCKET}/no/such/path", None, "does not exist: check the path or URL"),
        (f"s3://{BUCKET}/plain", _bad_credentials, "access denied ("),
        (f"s3://{BUCKET}/plain", _unknown_key, "access denied ("),
        (f"s3://{BUCKET}/plain", {"profile": "x"}, "do not build a pyarrow.fs.S3FileSystem ("),
        ("foo://bucket/train", None, "no filesystem knows foo:// URLs"),
        ("reference://train", {"target": "x"}, "do not build the reference:// filesystem ("),
    ],
)
def test_bad_inputs_say_what_to_check(
    s3: S3Server, urls: dict[str, str], dataset: str, options: Any, words: str
) -> None:
    storage_options = options(s3) if callable(options) else options
    storage_options = storage_options or s3.storage_options()
    with pytest.raises(DatasetError) as raised:
        plan_for_dataset(dataset, 2, 8, storage_options=storage_options)
    message = str(raised.value)
    assert words in message, message
    assert "\n" not in message
    if "access denied" in words:
        assert "AWS_ACCESS_KEY_ID" in message and "storage_options key / secret" in message
    if "do not build" in words:  # the filesystem's own words name the option it refused
        assert ("'profile'" if "S3FileSystem" in words else "'fo'") in message
        assert "filesystem= one you built" in message
    if "S3FileSystem" in words:
        assert "s3fs's" in message


@pytest.mark.timeout(30)
def test_unreachable_endpoint_fails_within_the_timeout() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(DatasetError) as raised:
        read_row_groups(
            f"s3://{BUCKET}/plain",
            storage_options={
                "endpoint_url": closed,
                "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
            },
        )
    assert time.monotonic() - started < 15
    message = str(raised.value)
    assert f"cannot reach the S3 endpoint {closed}" in message, message
    assert "AWS_ENDPOINT_URL or storage_options endpoint_url" in message


@pytest.mark.timeout(30)
def test_an_endpoint_that_never_answers_fails_within_the_request_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections are accepted by the kernel and never answered
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        options = {
            "endpoint_url": endpoint,
            "config_kwargs": {"read_timeout": 1, "retries": {"max_attempts": 1}},
        }
        started = time.monotonic()
        with pytest.raises(DatasetError, match=r"cannot reach the S3 endpoint .*Timeout"):
            read_row_groups(f"s3://{BUCKET}/plain", storage_options=options)
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_unreachable_gcs_endpoint_fails_within_the_retry_limit() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(DatasetError) as raised:
        read_row_groups(
            "gs://bucket/train",
            storage_options={"endpoint_url": closed, "token": "anon", "retry_time_limit": 1},
        )
    assert time.monotonic() - started < 15
    message = str(raised.value)
    assert f"gs://bucket/train: cannot reach the GCS endpoint {closed}" in message, message
    assert "STORAGE_EMULATOR_HOST or storage_options endpoint_url" in message


@pytest.mark.timeout(30)
@pytest.mark.skipif(importlib.util.find_spec("adlfs") is not None, reason="adlfs is installed")
def test_a_scheme_without_its_package_names_the_package() -> None:
    with pytest.raises(
        DatasetError, match=r"no filesystem for az:// is installed.*pip install adlfs"
    ):
        read_row_groups("az://container/train")


@pytest.mark.timeout(30)
def test_hdfs_without_hadoop_says_what_to_install() -> None:
    with pytest.raises(DatasetError) as raised:
        read_row_groups("hdfs://namenode:8020/data/train")
    message = str(raised.value)
    assert "hdfs://namenode:8020/data/train" in message
    assert "libhdfs" in message or "cannot connect to the namenode" in message


@pytest.mark.petastorm
@pytest.mark.timeout(60)
def test_storage_options_in_reader_kwargs_are_taken_once(
    s3: S3Server, urls: dict[str, str]
) -> None:
    options = s3.storage_options()
    plan, factory = make_shard_factory(
        urls["plain"], 1, 2, BATCH, reader_kwargs={"storage_options": options}
    )
    with factory() as batches:
        assert sum(len(batch["id"]) for batch in batches) == plan.rows_per_rank[1]
    with pytest.raises(ValueError, match="storage_options is given twice"):
        make_shard_factory(
            urls["plain"], 0, 2, BATCH, storage_options=options,
            reader_kwargs={"storage_options": options},
        )  # fmt: skip
    with pytest.raises(ValueError, match="not both"):
        make_shard_factory(urls["plain"], 0, 2, BATCH, storage_options=options, filesystem=object())


@pytest.mark.timeout(30)
def test_a_pyarrow_s3_filesystem_passed_as_filesystem(s3: S3Server, urls: dict[str, str]) -> None:
    from_options = read_row_groups(urls["partitioned"], storage_options=s3.storage_options())
    from_object = read_row_groups(urls["partitioned"], filesystem=s3.filesystem())
    assert from_object.files == from_options.files
    assert from_object.num_rows.tolist() == from_options.num_rows.tolist()
    with pytest.raises(DatasetError, match="bucket 'no-such-bucket' does not exist"):
        read_row_groups("s3://no-such-bucket/x", filesystem=s3.filesystem())


def _read_every_rank(dataset: str, **where: Any) -> tuple[ShardPlan, list[list[int]]]:
    shards = []
    plan = None
    for rank in range(WORLD_SIZE):
        plan, factory = make_shard_factory(
            dataset, rank, WORLD_SIZE, BATCH, sharding="row_groups", **where
        )
        with factory() as batches:
            shards.append(sorted(int(row) for batch in batches for row in batch["id"]))
    assert plan is not None
    return plan, shards


@pytest.mark.timeout(60)
def test_memory_filesystem_through_fsspec(tmp_path: Path) -> None:
    import fsspec

    local = Path(Layouts(SIZES).partitioned(tmp_path / "ds")[len("file://") :])
    memory = fsspec.filesystem("memory")
    memory.put(str(local), "/ddp-even-memory/partitioned", recursive=True)
    _, local_plan = plan_for_dataset(str(local), WORLD_SIZE, BATCH, sharding="row_groups")
    plan, shards = _read_every_rank("memory://ddp-even-memory/partitioned")
    assert plan.shards == local_plan.shards
    for rank, rows in enumerate(shards):
        assert rows == _planned_ids(plan, rank)
    assert sorted(row for rows in shards for row in rows) == list(range(sum(flat_sizes(SIZES))))
    with pytest.raises(DatasetError, match="memory:///ddp-even-memory/nothing does not exist"):
        read_row_groups("memory://ddp-even-memory/nothing")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["pyarrow", "fsspec"])
def test_local_filesystem_passed_as_filesystem(tmp_path: Path, kind: str) -> None:
    import fsspec
    import pyarrow.fs

    url = Layouts(SIZES).with_metadata(tmp_path / "ds")
    filesystem = pyarrow.fs.LocalFileSystem() if kind == "pyarrow" else fsspec.filesystem("file")
    groups = read_row_groups(url, filesystem=filesystem)
    assert groups.source == "_metadata" and groups.files == read_row_groups(url).files
    plan, shards = _read_every_rank(url, filesystem=filesystem)
    for rank, rows in enumerate(shards):
        assert rows == _planned_ids(plan, rank)


@pytest.mark.timeout(30)
def test_a_legacy_pyarrow_filesystem_is_refused_naming_what_to_pass(tmp_path: Path) -> None:
    # pyarrow 14's legacy S3FSWrapper (petastorm's old way to S3); pyarrow 16 removed the module.
    legacy = pytest.importorskip("pyarrow.filesystem")
    import fsspec

    url = Layouts(SIZES).plain(tmp_path / "ds")
    with pytest.raises(TypeError, match=r"got S3FSWrapper: .* \(S3FSWrapper's \.fs\)"):
        read_row_groups(url, filesystem=legacy.S3FSWrapper(fsspec.filesystem("file")))
    unwrapped = read_row_groups(url, filesystem=fsspec.filesystem("file"))
    assert unwrapped.files == read_row_groups(url).files


def train_from_remote(
    rank: int, world_size: int, url: str, storage_options: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """One DDP model trained one epoch per mode on balanced shards read from a server."""
    import torch

    from ddp_even import EvenLoader

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    results: dict[str, dict[str, Any]] = {}
    for mode in ("truncate", "cycle", "join"):
        loader = EvenLoader.from_parquet(
            url,
            BATCH,
            mode,
            sharding="row_groups",
            storage_options=storage_options,
            joinables=[model] if mode == "join" else (),
        )
        rows: list[int] = []
        length = len(loader)
        for batch in loader:
            loss = model(batch["value"].reshape(-1, 1)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rows += [int(row) for row in batch["id"]]
        results[mode] = {"rows": rows, "length": length, "stats": loader.stats.as_dict()}
    return results


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_four_ranks_train_from_s3_in_every_mode(s3: S3Server, urls: dict[str, str]) -> None:
    options = s3.storage_options()
    _check_every_mode(urls["plain"], options, env=s3.env())


def _check_every_mode(url: str, options: dict[str, Any], env: dict[str, str] | None = None) -> None:
    """Four ranks train from ``url`` in every mode, each reading what the plan gives it."""
    _, plan = plan_for_dataset(
        url, WORLD_SIZE, BATCH, sharding="row_groups", storage_options=options
    )
    assert plan.spread_rows <= max(flat_sizes(SIZES))
    runs = run_ranks(train_from_remote, WORLD_SIZE, url, options, timeout=150, env=env)
    planned = [_planned_ids(plan, rank) for rank in range(WORLD_SIZE)]
    batches = plan.batches_per_rank
    for rank, run in enumerate(runs):
        truncate, cycle, join = run["truncate"], run["cycle"], run["join"]
        # truncate: a prefix of the rank's plan, each row once, the rest reported as dropped.
        assert truncate["length"] == min(batches)
        assert len(truncate["rows"]) == len(set(truncate["rows"]))
        assert set(truncate["rows"]) <= set(planned[rank])
        dropped = len(planned[rank]) - len(truncate["rows"])
        assert truncate["stats"]["dropped_rows"][rank] == dropped
        # cycle: the first pass is the rank's plan, each row once; then short ranks repeat.
        assert cycle["length"] == max(batches)
        assert sorted(cycle["rows"][: len(planned[rank])]) == planned[rank]
        repeats = Counter(cycle["rows"][len(planned[rank]) :])
        assert set(repeats) <= set(planned[rank])
        # join: every rank reads exactly its plan once.
        assert join["length"] == batches[rank]
        assert sorted(join["rows"]) == planned[rank]
    every_row = sorted(row for run in runs for row in run["join"]["rows"])
    assert every_row == list(range(sum(flat_sizes(SIZES))))


# --- gs://, from a local GCS emulator ------------------------------------------------------


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GcsServer, dict[str, str]]]:
    """The emulator, holding the plain layout of SIZES and the one with a ``_metadata`` summary.

    Not the hive-partitioned one: the emulator lists no "directories" without ``recursive``
    (it ignores the delimiter real GCS answers with prefixes), so it shows no partitions."""
    import pyarrow.fs

    server = start_gcs_server(BUCKET)
    try:
        root = tmp_path_factory.mktemp("gcs")
        layouts = Layouts(SIZES)
        urls = {}
        for layout in ("plain", "with_metadata"):
            getattr(layouts, layout)(root / layout)
            pyarrow.fs.copy_files(
                str(root / layout),
                f"{BUCKET}/{layout}",
                source_filesystem=pyarrow.fs.LocalFileSystem(),
                destination_filesystem=server.filesystem(),
            )
            urls[layout] = f"gs://{BUCKET}/{layout}"
        yield server, urls
    finally:
        server.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["plain", "with_metadata"])
def test_every_rank_reads_its_planned_rows_from_gcs(
    gcs: tuple[GcsServer, dict[str, str]], layout: str
) -> None:
    server, urls = gcs
    options = server.storage_options()
    groups = read_row_groups(urls[layout], storage_options=options)
    assert groups.num_rows.tolist() == flat_sizes(SIZES)
    assert groups.source == ("_metadata" if layout == "with_metadata" else "footers")
    assert all(path.startswith(f"{BUCKET}/{layout}/") for path in groups.files)
    plan, shards = _read_every_rank(urls[layout], storage_options=options)
    for rank, rows in enumerate(shards):
        assert rows == _planned_ids(plan, rank), f"rank {rank}"
    assert sorted(row for rows in shards for row in rows) == list(range(sum(flat_sizes(SIZES))))


@pytest.mark.timeout(60)
def test_gcs_credentials_of_a_google_cloud_vm_come_from_its_metadata_server(
    gcs: tuple[GcsServer, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many VMs have no key file and no gcloud login: only the metadata server's service account.
    # The look for credentials before the first request must find those, and pyarrow use them.
    server, urls = gcs
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    options = {"endpoint_url": server.endpoint}  # no token='anon': the VM's credentials
    with metadata_server() as metadata:
        monkeypatch.setenv("GCE_METADATA_ROOT", metadata.host)
        groups = read_row_groups(urls["plain"], storage_options=options)
        assert groups.num_rows.tolist() == flat_sizes(SIZES)
        assert any(path.endswith("/token") for path in metadata.paths), metadata.paths
    # The same VM without its metadata server: no credentials anywhere, said at once.
    started = time.monotonic()
    with pytest.raises(DatasetError, match="no Google Cloud credentials found"):
        read_row_groups(urls["plain"], storage_options=options)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_cli_plans_a_gcs_dataset(gcs: tuple[GcsServer, dict[str, str]]) -> None:
    server, urls = gcs
    result = _cli(
        urls["plain"], "-w", "4", "-b", "8", "--json",
        "--storage-option", f"endpoint_url={server.endpoint}", "--storage-option", "token=anon",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    _, plan = plan_for_dataset(urls["plain"], 4, 8, storage_options=server.storage_options())
    assert document["plan"]["rows_per_rank"] == list(plan.rows_per_rank)
    assert document["num_files"] == len(SIZES)


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_four_ranks_train_from_gcs_in_every_mode(gcs: tuple[GcsServer, dict[str, str]]) -> None:
    server, urls = gcs
    _check_every_mode(urls["plain"], server.storage_options())
