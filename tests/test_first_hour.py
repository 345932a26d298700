"""A new user's first hour: the demo script, the examples' datasets and errors, no warnings.

* ``scripts/demo.sh`` runs in a copy of this tree with a ``.venv`` of its own, whose packages
  are this interpreter's (a ``.pth`` file): its install step installs only ddp_even itself,
  editable, into the copy's ``.venv``. It must keep its dataset in ``demo-data/`` and end with
  the commands to try next; the next install must be skipped.
* The examples refuse a dataset they did not write, and stop on a missing one with one line,
  not a traceback.
* Reading with ddp_even (the footers of the usual petastorm loop, a planned ``from_parquet``
  reader) raises no FutureWarning from ddp_even's own modules (nor does any test: the suite
  makes them errors).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
from click.testing import CliRunner, Result
from petastorm import make_batch_reader
from petastorm.pytorch import BatchedDataLoader

from ddp_even import EvenLoader
from tests.helpers.datasets import write_plain_dataset
from tests.helpers.lightning_and_accelerate import skip_without

pytestmark = pytest.mark.petastorm

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# examples/train.py's demo dataset, and the Lightning and accelerate examples' one.
TRAIN_DEMO_SIZES = [120, 8, 60, 16, 90, 4, 30, 12, 50, 10]
TRAINER_DEMO_SIZES = [120, 8, 60, 16, 90, 20, 10, 10]
NEXT_COMMANDS = [
    "Next, on the demo dataset in demo-data/:",
    "  .venv/bin/ddp-even plan demo-data --world-size 4 --batch-size 16 --sharding rows",
    "  .venv/bin/torchrun --nproc-per-node 2 examples/train.py --data demo-data --mode cycle "
    "--epochs 2",
    "  bash scripts/test.sh --fast    # adds the test tools to .venv and runs the fast tests",
]


def clean_environment(**extra: str) -> dict[str, str]:
    """This environment without what points Python at other code than the command's own."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    environment = {key: value for key, value in os.environ.items() if key not in dropped}
    return {**environment, **extra}


def row_group_sizes(directory: Path) -> list[int]:
    metadata = pq.read_metadata(directory / "part-00000.parquet")
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def copy_of_this_tree(destination: Path) -> Path:
    """The files git knows of (tracked or not ignored), as a fresh clone with local edits has."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)
    return destination


def venv_with_these_packages(tree: Path) -> None:
    """``tree/.venv``: a virtual environment that sees this interpreter's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tree / ".venv")], check=True)
    purelib = sysconfig.get_path("purelib", vars={"base": str(tree / ".venv")})
    # Plain paths: the .pth files there (this checkout's editable ddp_even) are not run.
    Path(purelib, "inherited.pth").write_text(sysconfig.get_path("purelib") + "\n")


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(900)
def test_demo_script_keeps_its_dataset_and_ends_with_what_to_try(tmp_path: Path) -> None:
    tree = copy_of_this_tree(tmp_path / "clone")
    venv_with_these_packages(tree)
    env = clean_environment()
    demo = subprocess.run(
        ["bash", "scripts/demo.sh", "--epochs", "1"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "Installing ddp_even[petastorm] into .venv with pip" in demo.stdout
    assert demo.stdout.rstrip().splitlines()[-4:] == NEXT_COMMANDS
    assert row_group_sizes(tree / "demo-data") == TRAIN_DEMO_SIZES
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "demo-data/"], cwd=ROOT, check=False
    ).returncode
    assert ignored == 0, "demo-data/ is ignored by git"

    # Nothing changed: the install is skipped.
    started = time.perf_counter()
    again = subprocess.run(
        ["bash", "scripts/install.sh", "petastorm"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    skipped_in = time.perf_counter() - started
    assert "is installed in .venv" in again.stdout
    assert skipped_in < 2.0

    # The first command it suggests works, with the ddp-even the script installed.
    plan = subprocess.run(
        NEXT_COMMANDS[1].split(),
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert plan.returncode == 0, plan.stderr
    assert "Every rank reads 100 rows" in plan.stdout


@pytest.mark.timeout(120)
def test_an_example_refuses_a_dataset_it_did_not_write(tmp_path: Path) -> None:
    # The example's own command, called in this process as click runs it from a shell.
    skip_without("accelerate")
    sys.path.insert(0, str(EXAMPLES))
    try:
        from train import DEMO_ROW_GROUP_SIZES, write_demo_dataset
        from train_accelerate import main as accelerate_example
    finally:
        sys.path.remove(str(EXAMPLES))
    other = tmp_path / "demo-data"
    write_demo_dataset(other)
    written = (other / "part-00000.parquet").read_bytes()

    def demo(data: Path) -> Result:
        return CliRunner().invoke(accelerate_example, ["--demo", "--data", str(data)])

    refused = demo(other)
    assert refused.exit_code == 2, refused.output
    assert (
        f"{other} holds a dataset of 400 rows in 10 row groups, not this example's demo dataset "
        "(334 rows in 8 row groups); give --data a new or empty directory"
    ) in " ".join(refused.output.split())
    assert (other / "part-00000.parquet").read_bytes() == written, "left as it was"
    assert list(DEMO_ROW_GROUP_SIZES) == TRAIN_DEMO_SIZES

    own = tmp_path / "demo-data-2ranks"
    done = demo(own)
    assert done.exit_code == 0, done.output
    assert row_group_sizes(own) == TRAINER_DEMO_SIZES
    written_at = (own / "part-00000.parquet").stat().st_mtime_ns
    again = demo(own)  # found and used again, as the example's next run does
    assert again.exit_code == 0, again.output
    assert (own / "part-00000.parquet").stat().st_mtime_ns == written_at


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_missing_dataset_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    done = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", str(EXAMPLES / "train.py"), "--data", str(missing)],
        env=clean_environment(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    line = f"Error: {missing} does not exist: check the path or URL"
    errors = [said for said in output.splitlines() if said.startswith("Error:")]
    # Each rank finds the path missing and says so; torchrun ends the other rank as soon as one
    # exits, so the second rank's line is there only if it got that far first.
    assert errors and set(errors) == {line} and len(errors) <= 2, output
    # What is left is torchrun's own report of the failed ranks; no rank's traceback.
    assert 'examples/train.py", line' not in output, output


@pytest.mark.timeout(120)
def test_no_future_warning_from_ddp_even(tmp_path: Path) -> None:
    # Reads a dataset the two ways ddp_even reads petastorm (the footers of the usual loop, a
    # planned reader) in one rank of gloo. pyproject.toml's filterwarnings makes a FutureWarning
    # attributed to a ddp_even module an error in every test; it is set here as well, so that
    # this test says what it checks (and checks it under any configuration).
    url = write_plain_dataset(tmp_path / "ds", [[5, 7], [3]])

    def one_pass() -> BatchedDataLoader:
        return BatchedDataLoader(make_batch_reader(url, num_epochs=1, workers_count=1), 4)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=FutureWarning, module=r"ddp_even(\.|$)")
            footers = EvenLoader(one_pass, mode="cycle")
            planned = EvenLoader.from_parquet(url, batch_size=4, mode="truncate", sharding="rows")
            steps = [sum(1 for _ in loader) for loader in (footers, planned) for _epoch in (0, 1)]
    finally:
        dist.destroy_process_group()
    # Both ways were taken: the loop's batches from the footers, the planned reader's rows.
    assert (footers.stats.sharding, planned.stats.sharding) == ("round_robin", "rows")
    assert steps == [4, 4, 4, 4]


def test_a_future_warning_from_ddp_even_fails_any_test() -> None:
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("deprecated", FutureWarning, "feed.py", 1, "ddp_even.runtime.feed")
    # petastorm's own, on pyarrow 14's legacy API, are expected (pyproject.toml says why).
    warnings.warn_explicit("deprecated", FutureWarning, "reader.py", 1, "petastorm.reader")
