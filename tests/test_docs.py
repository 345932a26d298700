"""README and docs say what the code does: every code block in them runs here, as written.

* ``python`` blocks run in one process (rank 0 of 1) in a namespace holding what the text calls
  "yours": ``url`` (a skewed demo dataset with float columns ``x`` and ``y``), ``rank``,
  ``world_size``, ``epochs``, ``ddp_model`` and ``optimizer``; remote-storage blocks read a local
  S3 server (``http://minio:9000`` in the text), Spark blocks a real DataFrame ``df`` and its
  ``converter`` (the TorchDistributor block runs its two ranks as Spark barrier tasks).
* ``python`` blocks of ``docs/trainers.md`` are excerpts of the examples and test jobs the
  trainer tests run (``tests/test_lightning.py``, ``tests/test_lightning_resume.py``,
  ``tests/test_accelerate.py``): each must appear there verbatim.
* ``bash``/``sh`` blocks: each command runs in a shell from the repository root, on a demo
  dataset (``demo-data`` in the text) or the local S3 server. Commands this test does not run
  (:data:`NOT_RUN_HERE`: another test runs them, or nothing here can) say why, and run with
  ``--help`` instead where they have it.

Also: README stays within 200 lines; docs/design.md's "Where things live" names every module
of the package and no other; every relative link leads to a file and heading that exist; every
error of ddp_even's that the docs name is importable from ``ddp_even`` and an
``EvenLoaderError``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.s3_server import S3Server, upload_directory

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]
# Where docs/trainers.md's blocks come from (each run by the trainer tests).
TRAINER_SOURCES = [
    "examples/train_lightning.py",
    "examples/train_accelerate.py",
    "examples/shard_loaders.py",
    "tests/helpers/lightning_resume_job.py",
]
# Commands of the docs not run here, by a part of them, with why (and what runs instead).
NOT_RUN_HERE = {
    "bash scripts/demo.sh": "pip first; tests/test_first_hour.py runs it in a copy of the tree",
    "examples/train.py --demo": "scripts/demo.sh's command: tests/test_first_hour.py runs it",
    "bash scripts/test.sh": "this suite is what it runs (CI runs it from a clean clone)",
    "torchrun --nnodes 2": "needs two machines; examples/train.py runs under torchrun here",
    "benchmarks.": "minutes each; tests/test_bench_*.py run their measurements",
    "scripts/soak.py": "hours; scripts/test.sh runs it for 3 minutes before this suite",
    "examples/train_lightning.py": "tests/test_lightning.py runs it (Lightning starts its ranks)",
    "examples/train_accelerate.py": "tests/test_accelerate.py runs it under torchrun",
    "accelerate launch": "tests/test_accelerate.py runs the example under torchrun",
    "examples/train_spark.py": "Java and a minute; tests/test_spark.py runs its converter cases",
}
# The python blocks' dataset: 10 row groups of skewed sizes, as examples/train.py's demo.
ROW_GROUPS = [120, 8, 60, 16, 90, 4, 30, 12, 50, 10]
MINIO = "http://minio:9000"


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        for match in re.finditer(r"^```(\w+)\n(.*?)^```$", text, re.S | re.M):
            line = text[: match.start()].count("\n") + 1
            found.append(Block(document, line, match.group(1), match.group(2)))
    return found


BLOCKS = _blocks()


def _of(
    language: set[str], *, documents: set[str] | None = None, exclude: frozenset[str] = frozenset()
) -> list[Any]:
    return [
        pytest.param(block, id=str(block))
        for block in BLOCKS
        if block.language in language
        and (documents is None or block.document in documents)
        and block.document not in exclude
    ]


def test_every_code_block_is_of_a_language_this_test_runs() -> None:
    assert {block.language for block in BLOCKS} <= {"python", "bash", "sh", "text"}


# --- python ------------------------------------------------------------------------------


def _x_and_y(directory: Path) -> str:
    """The demo dataset with float columns ``x`` and ``y`` (y = 2x + 1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rows = sum(ROW_GROUPS)
    x = [float(value) / rows for value in range(rows)]
    table = pa.table(
        {"x": pa.array(x, pa.float32()), "y": pa.array([2 * v + 1 for v in x], pa.float32())}
    )
    with pq.ParquetWriter(directory / "part-00000.parquet", table.schema) as writer:
        start = 0
        for size in ROW_GROUPS:
            writer.write_table(table.slice(start, size))
            start += size
    return directory.as_uri()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the python blocks call ``url``."""
    root = tmp_path_factory.mktemp("docs") / "x-and-y"
    _x_and_y(root)
    return root


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the shell blocks call ``demo-data``: the dataset ``scripts/demo.sh`` writes."""
    # By path: an installed package (a dependency's) is called ``examples`` too. Its helpers
    # (examples/skewed_parquet.py) are found as the example finds them run as a script.
    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("demo_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look themselves up there
    spec.loader.exec_module(example)
    root = tmp_path_factory.mktemp("docs") / "demo-data"
    example.write_demo_dataset(root)
    return root


def _yours(url: str, ddp: bool = False) -> dict[str, Any]:
    """What the blocks call yours; with ``ddp``, the model is a DDP model (a group must be up)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return {
        "url": url,
        "rank": 0,
        "world_size": 1,
        "epochs": 2,
        "ddp_model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }


def _run_in_order(blocks: list[Block], namespace: dict[str, Any], replace: dict[str, str]) -> None:
    """Run a document's blocks one after the other in one namespace, as a reader would."""
    for block in blocks:
        code = block.code
        for old, new in replace.items():
            code = code.replace(old, new)
        exec(compile(code, str(block), "exec"), namespace)


def _python_of(document: str) -> list[Block]:
    return [block for block in BLOCKS if block.document == document and block.language == "python"]


LOCAL_DOCUMENTS = [
    document
    for document in DOCUMENTS
    if _python_of(document)
    and document not in ("docs/trainers.md", "docs/spark.md", "docs/remote-storage.md")
]


@pytest.mark.petastorm
@pytest.mark.timeout(180)
@pytest.mark.parametrize("document", LOCAL_DOCUMENTS)
def test_python_blocks_run(document: str, dataset: Path) -> None:
    import torch.distributed as dist

    # Rank 0 of a one-rank gloo group, so that the DDP model is one (the README registers
    # ddp_even's hook on it).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        namespace = _yours(dataset.as_uri(), ddp=True)
        _run_in_order(_python_of(document), namespace, {})
        namespace.clear()  # the model and loaders before the group: docs/using.md
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("block", _of({"python"}, documents={"docs/trainers.md"}))
def test_trainer_blocks_are_excerpts_of_what_the_trainer_tests_run(block: Block) -> None:
    wanted = textwrap.dedent(block.code).rstrip("\n").splitlines()
    for source in TRAINER_SOURCES:
        lines = (ROOT / source).read_text().splitlines()
        for start, line in enumerate(lines):
            indent = line[: len(line) - len(line.lstrip())]
            window = lines[start : start + len(wanted)]
            expected = [indent + want if want else "" for want in wanted]
            if window == expected:
                return
    pytest.fail(f"{block} is not an excerpt of {', '.join(TRAINER_SOURCES)}")


# --- remote storage: a local S3 server ------------------------------------------------------


@pytest.fixture(scope="module")
def s3_dataset(s3: S3Server, dataset: Path) -> S3Server:
    upload_directory(s3, dataset, "bucket/train")
    return s3


@pytest.mark.petastorm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", _of({"python"}, documents={"docs/remote-storage.md"}))
def test_remote_storage_blocks_run_against_a_local_s3(block: Block, s3_dataset: S3Server) -> None:
    code = block.code.replace(MINIO, s3_dataset.endpoint)
    namespace = _yours("s3://bucket/train")
    exec(compile(code, str(block), "exec"), namespace)


# --- Spark -------------------------------------------------------------------------------


@pytest.mark.petastorm
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_spark_blocks_run_on_a_converter(spark: Any, tmp_path: Path) -> None:
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, tmp_path.as_uri())
    frame = spark.range(0, 400, numPartitions=4).selectExpr(
        "cast(id as float) as x", "cast(2 * id + 1 as float) as y"
    )
    converter = make_spark_converter(frame)
    try:
        namespace = {**_yours(""), "converter": converter, "df": frame}
        _run_in_order(_python_of("docs/spark.md"), namespace, {})
    finally:
        converter.delete()


# --- shell -------------------------------------------------------------------------------


def _commands(code: str) -> Iterator[str]:
    joined = code.replace("\\\n", " ")
    for line in joined.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            yield command


def _why_not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN_HERE.items() if start in command), None)


def _shell(command: str, dataset: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    venv_bin = str(Path(sys.executable).parent)
    command = command.replace(".venv/bin/", venv_bin + "/").replace("demo-data", str(dataset))
    return subprocess.run(
        command,
        shell=True,
        cwd=ROOT,
        env={**os.environ, **env, "PATH": venv_bin + os.pathsep + os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _run_shell_block(block: Block, dataset: Path, s3: S3Server | None) -> None:
    env: dict[str, str] = {}
    # A script's --help says the same for every command of the block that names it (and costs
    # its imports: about 4 s of CPU for Lightning's example), so it runs once.
    helped_scripts: set[str] = set()
    for command in _commands(block.code):
        if s3 is not None and MINIO in command:
            command = command.replace(MINIO, s3.endpoint)
            env = s3.env()
        why = _why_not_run(command)
        if why is not None:
            script = next((word for word in shlex.split(command) if word.endswith(".py")), None)
            if script is not None and script not in helped_scripts:
                helped_scripts.add(script)
                helped = _shell(f"python {script} --help", dataset, env)
                assert helped.returncode == 0, (command, helped.stdout + helped.stderr)
            continue
        done = _shell(command, dataset, env)
        assert done.returncode == 0, (block, command, done.stdout[-3000:], done.stderr[-3000:])


# Only the blocks that read the local S3 server ask for it: the tests that do share one
# pytest-xdist worker (tests/conftest.py), and the others, minutes of torchrun jobs and
# examples' start-up, would wait there in a queue instead of running beside them.
SHELL_BLOCKS = _of({"bash", "sh"})


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "block", [param for param in SHELL_BLOCKS if MINIO not in param.values[0].code]
)
def test_shell_blocks_run(block: Block, demo_data: Path) -> None:
    _run_shell_block(block, demo_data, None)


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "block", [param for param in SHELL_BLOCKS if MINIO in param.values[0].code]
)
def test_shell_blocks_run_against_a_local_s3(
    block: Block, demo_data: Path, s3_dataset: S3Server
) -> None:
    _run_shell_block(block, demo_data, s3_dataset)


# --- size and layout ---------------------------------------------------------------------


def test_the_readme_fits_the_first_hour() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_docs_are_reference_not_a_diary() -> None:
    """One current table per benchmark: no commit hashes, dates or CI logs (history is git's, a
    change's measurements go in its closing note), and a performance page of at most 300 lines."""
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 300
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        hashes = [
            word
            for word in re.findall(r"\b[0-9a-f]{7,40}\b", text)
            if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)
        ]
        assert not hashes, (document, hashes)
        assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), document
        assert "commit" not in text.lower(), document


def test_where_things_live_names_every_module() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    tree = design.split("## Where things live", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"[\w/]+\.py", tree))
    package = ROOT / "ddp_even"
    modules = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "__init__.py" or path.parent == package
    }
    assert listed == modules, {
        "not listed": sorted(modules - listed),
        "listed but missing": sorted(listed - modules),
    }


# --- links and names --------------------------------------------------------------------------

# A Markdown link to a path of this repository (not a URL), with its optional #anchor.
_RELATIVE_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)([^)\s#]*)(?:#([^)\s]*))?\)")


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings
    }


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_lead_to_a_file_and_heading_that_exist(document: str) -> None:
    source = ROOT / document
    text = source.read_text()
    broken = []
    for target, anchor in _RELATIVE_LINK.findall(text):
        linked = (source.parent / target).resolve() if target else source
        if not linked.exists():
            broken.append(f"{target}: no such file from {document}'s folder")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
            broken.append(f"{target}#{anchor}: no such heading")
    assert not broken, broken


def test_every_error_the_docs_name_is_one_of_ddp_evens_importable_from_the_package() -> None:
    import ddp_even
    from ddp_even import errors

    named = {
        name
        for document in DOCUMENTS
        for name in re.findall(r"`(\w+Error)`", (ROOT / document).read_text())
    }
    ours = {name for name in named if hasattr(errors, name)}
    assert ours, "the docs name ddp_even's errors"
    for name in sorted(ours):
        error = getattr(ddp_even, name, None)
        assert error is getattr(errors, name), f"{name} is not importable from ddp_even"
        assert issubclass(error, ddp_even.EvenLoaderError), f"{name} is no EvenLoaderError"
    # The others are Python's, petastorm's or Spark's own, and the docs say whose.
    assert named - ours <= {
        "RuntimeError",
        "TypeError",
        "ValueError",
        "NoDataAvailableError",
        "Py4JJavaError",
    }


# --- the README's loop, as a user runs it -------------------------------------------------------

# What the README's loop calls "yours", on every rank of a torchrun job.
_README_LOOP_PROLOGUE = """
import sys

import torch
import torch.distributed as dist
from petastorm import make_batch_reader
from petastorm.pytorch import BatchedDataLoader

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
url, epochs = sys.argv[1], 2
torch.manual_seed(0)
ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
"""


@pytest.mark.petastorm
@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_the_readmes_loop_runs_quietly_and_says_each_epoch_once(
    dataset: Path, tmp_path: Path
) -> None:
    """Copied into a script and run by torchrun on 2 ranks: no warning from any library, and
    one summary per epoch (rank 0's log)."""
    (loop,) = [block for block in _python_of("README.md") if "EvenLoader(one_pass" in block.code]
    script = tmp_path / "train.py"
    script.write_text(_README_LOOP_PROLOGUE + loop.code + "\ndist.destroy_process_group()\n")
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        dataset.as_uri(),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Warning" not in output, output
    summaries = [line for line in output.splitlines() if line.startswith("epoch ")]
    assert [line.split()[:3] for line in summaries] == [
        ["epoch", "0", "cycle"],
        ["epoch", "1", "cycle"],
    ], output
