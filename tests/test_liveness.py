"""Liveness, not patience: a peer fails when it is gone, never because it is busy elsewhere.

Real gloo ranks (two unless a case says three), ``timeout=2`` (how long a peer may show no
sign of life):

* pauses of 2x and 5x the timeout by either rank, before the first epoch, inside a step (a
  slow read), between steps, at the last step and between epochs (an evaluation after an
  epoch), with a real DDP model taking optimizer steps: no error, the same batches;
* SIGKILL of a rank at each point where the others then wait in ddp_even (also of rank 0
  hosting the TCP store, and on three ranks): every survivor raises ddp_even's
  ``PeerTimeoutError`` naming it as dead within ``timeout`` + 2 s, not gloo's error; so does
  a rank that makes its loader only after rank 0, the store's host, died;
* SIGSTOP of a rank (also of rank 0 with the store frozen in its process, and at the last
  step) and a main thread holding the GIL: named as stalled, with what it was doing, within
  ``timeout`` + 2 s of its freezing; continued, it raises too (``late``);
* a main thread blocked with the GIL released (a deadlock): busy, named after the training
  group's timeout with where it stood still;
* a peer that never makes an ``EvenLoader`` is waited for up to the training group's timeout,
  and the error quotes that timeout, never another;
* under ``torchrun`` (its agent hosts the store): at every point, ranks 0 and 1 in turn, a pause
  and a kill (one inside ``backward()``, through ``ddp_even.allreduce_hook``; the agent looking
  every 10 s: at its usual pace it stops the other workers itself as soon as one dies), and a
  frozen rank at each point where the others wait in ddp_even.

A rank killed while the others are inside DDP's own all-reduce is in
``tests/test_gradient_hook.py``: named there by ``ddp_even.allreduce_hook``, gloo's error without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.liveness_job import POINTS, Act, Job, expected_epochs, run_on_ranks
from tests.helpers.spawn import RankError, run_ranks

# timing: these tests bound how soon a fault is named, in seconds (pyproject.toml's markers).
pytestmark = [pytest.mark.multirank, pytest.mark.timing]

TIMEOUT = 2.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("shape", "ddp", "factor"), [("known", True, 5), ("windows", False, 2)], ids=str
)
def test_a_live_rank_that_pauses_anywhere_is_waited_for(shape: str, ddp: bool, factor: int) -> None:
    seconds = factor * TIMEOUT
    acts = (
        Act("before_first_epoch", 1, "pause", seconds),
        Act("inside_step", 0, "pause", seconds),
        Act("between_steps", 1, "pause", seconds),
        Act("last_step", 0, "pause", seconds),
        Act("between_epochs", 1, "pause", seconds),
    )
    results, _ = run_on_ranks(Job(acts, shape=shape, timeout=TIMEOUT, ddp=ddp), 2, timeout=120)
    for rank, result in enumerate(results):
        assert isinstance(result, dict) and result["error"] is None, (rank, result)
        assert result["seen"] == expected_epochs(rank), (rank, result)


@pytest.mark.timeout(60)
def test_a_rank_that_makes_its_loader_after_the_store_host_died_names_it_dead() -> None:
    # Its connections of its own to the store are made then: each gives up at once (the
    # server's port refuses), where a clone of the job's store would retry for the store's
    # timeout (30 minutes by default).
    acts = (
        Act("before_first_epoch", 0, "kill"),
        Act("before_loader", 1, "await_fault", seconds=0.3),
    )
    results, faults = run_on_ranks(
        Job(acts, timeout=TIMEOUT, ddp=True), 2, timeout=45, tcp_store=True
    )
    survivor = results[1]
    assert isinstance(survivor, dict), survivor
    assert survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["states"] == {0: "dead"}, survivor
    assert survivor["at"] - faults[0, "before_first_epoch"] <= TIMEOUT + 2, survivor


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("point", "shape", "ddp", "victim", "ranks"),
    [
        ("before_first_epoch", "known", True, 1, 2),
        ("between_epochs", "known", True, 1, 2),
        ("between_steps", "windows", False, 1, 2),
        ("last_step", "known", True, 1, 2),
        # A slow read with no collective of the loop's own: the survivors wait in ddp_even.
        ("inside_step", "windows", False, 1, 2),
        # Rank 0 hosts the TCP store here: the store goes with it.
        ("before_first_epoch", "known", True, 0, 2),
        ("between_epochs", "known", True, 0, 2),
        ("last_step", "known", True, 0, 2),
        # Three ranks: both survivors name the one that died.
        ("between_steps", "windows", False, 1, 3),
        ("last_step", "known", True, 2, 3),
        ("between_epochs", "known", True, 0, 3),
    ],
    ids=str,
)
def test_a_killed_rank_is_named_dead_within_the_timeout(
    point: str, shape: str, ddp: bool, victim: int, ranks: int
) -> None:
    results, faults = run_on_ranks(
        Job((Act(point, victim, "kill"),), shape=shape, timeout=TIMEOUT, ddp=ddp),
        ranks,
        timeout=120,
        tcp_store=victim == 0,
    )
    for survivor in (result for rank, result in enumerate(results) if rank != victim):
        assert isinstance(survivor, dict), survivor  # ddp_even's error, not gloo's RuntimeError
        assert survivor["error"] == "PeerTimeoutError", survivor
        assert survivor["missing"] == (victim,), survivor
        assert survivor["states"] == {victim: "dead"}, survivor
        assert f"rank {victim}" in survivor["message"] and "dead" in survivor["message"], survivor
        assert not survivor["late"]
        assert survivor["at"] - faults[victim, point] <= TIMEOUT + 2, survivor
    died = f"rank {victim} died (signal SIGKILL) without a result"
    assert results[victim] == RankError("ProcessExited", died)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("point", "victim", "doing", "shape"),
    [
        ("between_epochs", 1, "outside the loader", "known"),
        ("before_first_epoch", 1, "not iterating yet", "known"),
        ("last_step", 1, "outside the loader", "known"),
        # A slow read frozen: the others wait in ddp_even's agreement on the next step.
        ("inside_step", 1, "inside the loader (reading its source)", "windows"),
        # Rank 0 hosts the TCP store here: the store freezes with it.
        ("between_epochs", 0, "outside the loader", "known"),
    ],
    ids=str,
)
def test_a_frozen_rank_is_named_stalled_with_what_it_was_doing(
    point: str, victim: int, doing: str, shape: str
) -> None:
    frozen_s = TIMEOUT + 8
    # With known lengths a DDP step is the loop's own collective; in windows, none (the
    # others would wait in DDP's all-reduce, not in ddp_even, for a rank frozen in its read).
    job = Job((Act(point, victim, "stop", frozen_s),), shape, TIMEOUT, ddp=shape == "known")
    results, faults = run_on_ranks(
        job,
        timeout=90,
        tcp_store=victim == 0,
    )
    survivor = results[1 - victim]
    assert isinstance(survivor, dict) and survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == (victim,), survivor
    assert survivor["states"] == {victim: "stalled"}, survivor
    message = survivor["message"]
    assert f"rank {victim} is stalled" in message and "its process is stopped" in message, message
    assert doing in message, message
    # The timeout the user set, and no other.
    assert "timeout 2 s" in message and "600" not in message and "1800" not in message, message
    assert survivor["at"] - faults[victim, point] <= TIMEOUT + 2, survivor
    # Continued after the survivor gave up on it: it raises too, naming itself.
    late = results[victim]
    assert isinstance(late, dict) and late["error"] == "PeerTimeoutError", late
    assert late["late"] and late["missing"] == (victim,), late


@pytest.mark.timeout(120)
def test_a_main_thread_holding_the_gil_is_named_stalled() -> None:
    results, _ = run_on_ranks(
        Job((Act("between_epochs", 1, "hold_gil"),), timeout=TIMEOUT, ddp=True), 2
    )
    survivor = results[0]
    assert isinstance(survivor, dict) and survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == (1,) and survivor["states"] == {1: "stalled"}, survivor
    assert "its process runs but its heartbeat does not" in survivor["message"], survivor
    # Its own heartbeat thread did not run either: once the GIL is free, it knows it was late.
    late = results[1]
    assert isinstance(late, dict) and late["error"] == "PeerTimeoutError", late
    assert late["late"] and late["missing"] == (1,), late


@pytest.mark.timeout(120)
def test_a_deadlocked_main_thread_is_named_busy_after_the_training_timeout() -> None:
    # Blocked with the GIL released (a lock, a collective of its own): its heartbeat goes on,
    # so it is waited for as DDP would wait, then named with where it stood still.
    stuck_s, training_timeout_s = 16.0, 5.0
    results, faults = run_on_ranks(
        Job((Act("between_epochs", 1, "pause", stuck_s),), timeout=TIMEOUT, ddp=True),
        pg_timeout=training_timeout_s,
    )
    survivor = results[0]
    assert isinstance(survivor, dict) and survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == (1,) and survivor["states"] == {1: "busy"}, survivor
    message = survivor["message"]
    assert "training group's timeout (5 s)" in message and "outside the loader" in message
    waited = survivor["at"] - faults[1, "between_epochs"]
    assert training_timeout_s <= waited <= training_timeout_s + 4, survivor


def _never_makes_a_loader(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_even import EvenLoader, PeerTimeoutError

    if rank == 1:
        time.sleep(10)  # a loop on rank 0 only: this rank never iterates an EvenLoader
        return {"error": None}
    began = time.monotonic()
    try:
        list(EvenLoader([[1], [2]], "truncate", timeout=TIMEOUT))
    except PeerTimeoutError as error:
        return {
            "error": str(error),
            "states": error.states,
            "timeout": error.timeout,
            "waited": time.monotonic() - began,
        }
    return {"error": None}


@pytest.mark.timeout(90)
def test_a_rank_with_no_loader_is_waited_for_up_to_the_training_timeout() -> None:
    result = run_ranks(_never_makes_a_loader, 2, timeout=60, pg_timeout=6)[0]
    assert result["states"] == {1: "unseen"} and result["timeout"] == 6, result
    message = result["error"]
    assert "rank 1 never made an EvenLoader" in message, message
    assert "training group's timeout (6 s)" in message, message
    assert 6 <= result["waited"] < 6 + 4, result


def _torchrun(
    out: Path, job: dict[str, Any], monitor_s: float = 0.2
) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).parent.parent
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node=2",
        f"--monitor-interval={monitor_s}",
        str(root / "tests" / "helpers" / "liveness_job.py"),
        str(out),
        json.dumps(job),
    ]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=150, check=False
    )


# How often torchrun's agent looks at its workers in the killed-rank test: its first look must
# come after the survivor has named the dead rank (TIMEOUT, then a roll call of 1.5 s). The
# victim dies 5 to 9 s after the workers start (torch imported, a DDP model built; later under
# load), and at 10 s the agent's first look came 0.7 to 0.8 s after the kill in 2 of the 6 cases
# under a CPU hog, stopping the survivor before it could name the dead rank.
AGENT_LOOKS_EVERY_S = 20

# Every point of tests/helpers/liveness_job.py, and the rank that acts there under torchrun.
TORCHRUN_CASES = [(point, index % 2) for index, point in enumerate(POINTS)]


@pytest.mark.timeout(200)
def test_under_torchrun_pauses_are_waited_for(tmp_path: Path) -> None:
    acts = [
        {"point": point, "victim": victim, "action": "pause", "seconds": 3 * TIMEOUT}
        for point, victim in TORCHRUN_CASES
    ]
    # The DDP model averages through ddp_even's hook: the pause inside backward is waited for.
    job = {"acts": acts, "timeout": TIMEOUT, "ddp": True, "hook": True}
    paused = _torchrun(tmp_path, job)
    assert paused.returncode == 0, paused.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["error"] is None and result["seen"] == expected_epochs(rank), result


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("point", "doing"),
    [
        ("before_first_epoch", "not iterating yet"),
        ("between_epochs", "outside the loader"),
        ("last_step", "outside the loader"),
    ],
)
def test_under_torchrun_a_frozen_rank_is_named_stalled(
    tmp_path: Path, point: str, doing: str
) -> None:
    # Where the others then wait in ddp_even: a rank frozen where they wait in DDP's own
    # all-reduce is named at the training group's timeout (tests/test_gradient_hook.py).
    stop = {"point": point, "victim": 1, "action": "stop", "seconds": TIMEOUT + 5}
    _torchrun(tmp_path, {"acts": [stop], "timeout": TIMEOUT, "ddp": True})
    survivor = json.loads((tmp_path / "result-0.json").read_text())
    assert survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == [1] and survivor["states"] == {"1": "stalled"}, survivor
    assert doing in survivor["message"], survivor
    began = float((tmp_path / f"fault-1-{point}").read_text())
    assert survivor["at"] - began <= TIMEOUT + 2, survivor


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("point", "victim"), TORCHRUN_CASES, ids=str)
def test_under_torchrun_a_killed_rank_is_named_dead(
    tmp_path: Path, point: str, victim: int
) -> None:
    # torchrun's agent stops the other workers once it sees one die, looking every
    # AGENT_LOOKS_EVERY_S from the workers' start, so that the survivor can show what it raises
    # first. The agent hosts the store, which lives on.
    kill = {"point": point, "victim": victim, "action": "kill"}
    job = {"acts": [kill], "timeout": TIMEOUT, "ddp": True, "hook": True}
    done = _torchrun(tmp_path, job, monitor_s=AGENT_LOOKS_EVERY_S)
    assert done.returncode != 0  # the agent reports the dead worker
    survivor = json.loads((tmp_path / f"result-{1 - victim}.json").read_text())
    assert survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == [victim], survivor
    assert survivor["states"] == {str(victim): "dead"}, survivor
    assert f"rank {victim} is dead" in survivor["message"], survivor
    killed_at = float((tmp_path / f"fault-{victim}-{point}").read_text())
    assert survivor["at"] - killed_at <= TIMEOUT + 2, survivor
