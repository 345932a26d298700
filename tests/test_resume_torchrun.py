"""A real preemption: ``torchrun --max-restarts`` restarts a job whose rank was SIGKILLed.

``tests/helpers/resume_job.py`` trains every mode for two epochs on 4 ranks, checkpointing
model, optimizer and loader every 2 steps; one rank is killed mid-epoch once in each mode, and
the restarted job resumes from the last checkpoint. What each rank trained on in every epoch
(up to the checkpoint in the lost attempt, then after it) and the final weights must equal an
uninterrupted run's (the same job's code on 4 spawned ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.resume_job import MODES, uninterrupted
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.multirank

WORLD_SIZE = 4
JOB = Path(__file__).parent / "helpers" / "resume_job.py"


def _torchrun(out: Path, *extra: str, max_restarts: int) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={WORLD_SIZE}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        str(JOB),
        str(out),
        *extra,
    ]
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=200, check=False
    )


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_killed_rank_resumes_every_mode_without_losing_or_repeating_data(
    tmp_path: Path,
) -> None:
    (tmp_path / "reference").mkdir()
    run_ranks(uninterrupted, WORLD_SIZE, tmp_path / "reference", timeout=120)
    killed = _torchrun(tmp_path / "killed", "--kill", max_restarts=len(MODES))
    assert killed.returncode == 0, killed.stderr[-3000:]
    # torchrun saw each kill and restarted the job each time.
    assert killed.stderr.count("Signals.SIGKILL") + killed.stderr.count("exitcode: -9") >= 1, (
        killed.stderr[-3000:]
    )
    for mode in MODES:
        for rank in range(WORLD_SIZE):
            name = f"{mode}-{rank}.json"
            expected = json.loads((tmp_path / "reference" / f"trained-{name}").read_text())
            got = json.loads((tmp_path / "killed" / f"trained-{name}").read_text())
            assert got == expected, (mode, rank)
            weights = json.loads((tmp_path / "killed" / f"weights-{name}").read_text())
            reference_weights = json.loads((tmp_path / "reference" / f"weights-{name}").read_text())
            assert weights == pytest.approx(reference_weights, abs=1e-6), (mode, rank)
