"""ddp_even's own connections to the job's store (``liveness/heartbeat.own_connection``).

Real TCP stores, no process group: a connection of one's own reads what the job's store
holds under its prefixes, with its own short timeout, and leaves the job's store's timeout as
it was; once the store's server process is gone, making one fails at once instead of
retrying for the store's timeout (30 minutes by default), and a connection the server's death
broke is dropped (the next use connects again, and is refused). The process serving a store
is found and read from the kernel (running, stopped, gone), and an answer that comes after the
watch gave up on its question counts as the store's sign of life.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from ddp_even.liveness.heartbeat import _Beater, own_connection
from ddp_even.liveness.peers import Watch, connection_lost
from ddp_even.liveness.verdict import store_server_state

LONG = datetime.timedelta(minutes=30)


def _prefixed(client: dist.Store) -> dist.Store:
    # As init_process_group and torchrun wrap theirs.
    return dist.PrefixStore("default_pg", dist.PrefixStore("rendezvous/0", client))


def test_an_own_connection_reads_the_jobs_keys_with_its_own_timeout() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=LONG)
    job_store = _prefixed(server)
    job_store.set("ddp_even/heartbeat/0", "7")

    connection = own_connection(job_store, 1.5)

    assert connection is not job_store
    assert connection.get("ddp_even/heartbeat/0") == b"7"
    assert connection.timeout == datetime.timedelta(seconds=1.5)
    assert job_store.timeout == LONG


class HostedStore:
    """A TCP store served by a process of its own, which the test can kill."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, datetime, torch.distributed as dist\n"
                "timeout = datetime.timedelta(seconds=60)\n"
                "store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=timeout)\n"
                "print(store.port, flush=True)\n"
                "sys.stdin.read()\n",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        port = int(self._process.stdout.readline())
        self.job_store = _prefixed(dist.TCPStore("127.0.0.1", port, 1, False, timeout=LONG))

    def kill(self) -> None:
        self._process.kill()
        self._process.wait()

    def signal(self, number: int) -> None:
        os.kill(self._process.pid, number)

    def freeze(self) -> None:
        """SIGSTOP the server's process, returning once every thread of it has stopped: until
        the thread the signal went to is scheduled, the others (the store's server among them)
        still run, and on a busy machine still answer."""
        self.signal(signal.SIGSTOP)
        tasks = f"/proc/{self._process.pid}/task"
        deadline = time.monotonic() + 10
        while not all(_state(f"{tasks}/{task}/stat") == "T" for task in os.listdir(tasks)):
            assert time.monotonic() < deadline, "the store's process did not stop within 10 s"
            time.sleep(0.001)


def _state(stat_path: str) -> str:
    """A thread's state letter in /proc (``T``: stopped by a signal)."""
    with open(stat_path) as stat:
        return stat.read().rpartition(")")[2].split()[0]


@pytest.mark.timeout(60)
def test_no_connection_is_made_to_a_store_whose_server_is_gone() -> None:
    hosted = HostedStore()
    hosted.kill()

    began = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        own_connection(hosted.job_store, 5.0)

    assert time.monotonic() - began < 1.0
    assert hosted.job_store.timeout == LONG


@pytest.mark.timeout(60)
def test_a_connection_the_servers_death_broke_is_dropped_and_the_death_named(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A rank that outlives its job (a SIGSTOPped one woken after the others left) would
    # otherwise send each heartbeat and each look at its peers on the broken connection, and
    # torch logs every such send with its stack.
    hosted = HostedStore()
    beater = _Beater(hosted.job_store, 1, 10.0)
    watch = Watch(hosted.job_store)
    beater.beat()
    assert watch.look([1]) is not None
    hosted.kill()

    for _ in range(5):
        beater.beat()
        assert watch.look([1]) is None

    assert isinstance(watch.store_error, ConnectionRefusedError)
    assert connection_lost(str(watch.store_error))
    logged = capfd.readouterr().err
    # At most one failed request per connection (the heartbeat's, the watch's).
    assert logged.count("TCPStore.cpp") <= 2, logged


@pytest.mark.timeout(60)
def test_a_store_that_stops_answering_is_silent_from_the_unanswered_question() -> None:
    # A frozen server (its host SIGSTOPped) never answers; the watch gives up after a second,
    # but the store has been silent since the question, and the timeout counts from there.
    hosted = HostedStore()
    watch = Watch(hosted.job_store)
    assert watch.look([1]) is not None
    hosted.freeze()
    try:
        asked = time.monotonic()
        assert watch.look([1]) is None
        assert time.monotonic() - asked >= 0.9
        assert watch.store_failing_since is not None
        assert watch.store_failing_since - asked < 0.5  # not after the 1 s wait
        assert isinstance(watch.store_error, TimeoutError)
    finally:
        hosted.signal(signal.SIGCONT)
        hosted.kill()


@pytest.mark.timeout(60)
def test_the_process_serving_a_store_is_read_from_the_kernel_running_stopped_or_gone() -> None:
    # No heartbeat of its host seen: the process is found by the store's listening socket.
    hosted = HostedStore()
    watch = Watch(hosted.job_store)
    assert store_server_state(watch, None, me=1) == "running"
    hosted.freeze()
    try:
        assert store_server_state(watch, None, me=1) == "stopped"
    finally:
        hosted.signal(signal.SIGCONT)
    hosted.kill()
    assert store_server_state(watch, None, me=1) == "gone"


@pytest.mark.timeout(60)
def test_a_store_that_answers_late_is_not_silent_since_before_its_answer() -> None:
    # A store that waits for a core answers after the watch gave up on the question: the
    # answer is a sign of life, and its silence counts from there.
    hosted = HostedStore()
    watch = Watch(hosted.job_store)
    assert watch.look([1]) is not None
    connection = watch.store
    hosted.freeze()
    try:
        assert watch.look([1]) is None
        failing_since = watch.silent_since()
        assert failing_since is not None
    finally:
        hosted.signal(signal.SIGCONT)
    continued = time.monotonic()
    deadline = continued + 10
    while (watch.silent_since() or 0.0) < continued:
        assert time.monotonic() < deadline, "the late answer was not counted"
        time.sleep(0.01)
    assert watch.look([1]) is not None
    assert watch.silent_since() is None
    # Slow is not broken: the late answer came on the connection asked, and it is kept.
    assert watch.store is connection
    hosted.kill()
