"""What the heartbeats cost the job's store and each rank: 2, 4 and a simulated 64 ranks.

    python -m benchmarks.bench_heartbeat            # 2, 4 and 64 writers, 10 s each
    python -m benchmarks.bench_heartbeat --quick    # 3 s each

One ``TCPStore`` server runs in a process of its own, as rank 0 or torchrun's agent hosts it.
Each simulated rank is a thread of this process with its own client connection, doing what
``ddp_even/liveness/heartbeat.py``'s thread does: one ``set`` of its :class:`Beat` under its
key every :func:`beat_interval` (1 s for any ``timeout`` of 4 s or more). One more client
reads every writer's beat with one ``check`` and one ``multi_get`` every
:func:`poll_interval`, as a rank waiting in ddp_even does (nothing is read on the fast path).

Reported per writer count: the beats written per second, each ``set``'s latency (median and
99th percentile), the bytes a beat sends (key and value, before the store's framing), the
client thread's CPU time per beat, the store server's CPU time as a share of one core, and a
reader's look at every writer (latency). Threads share this process's GIL, so client-side
numbers are upper bounds of what one rank's thread costs; the server's CPU is what a real job's
store host pays.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from torch._C._distributed_c10d import TCPStore

from benchmarks.report import warn_if_loaded, write_results
from ddp_even.liveness.heartbeat import OUTSIDE, Beat, beat_interval, heartbeat_key, host_token
from ddp_even.liveness.peers import poll_interval

# The loader's timeout the beats are paced for (the beat interval is then its longest, 1 s).
TIMEOUT_S = 30.0
_SERVER = (
    "import sys, time, datetime; from torch.distributed import TCPStore; "
    "store = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, "
    "timeout=datetime.timedelta(seconds=60)); time.sleep(3600)"
)


@dataclass(frozen=True)
class BenchConfig:
    writers: tuple[int, ...] = (2, 4, 64)
    seconds: float = 10.0
    timeout: float = TIMEOUT_S


def _cpu_s(pid: int) -> float:
    """A process's user and system CPU seconds (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(port: int) -> Any:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def _writer(store: Any, rank: int, interval: float, until: float, out: dict[int, Any]) -> None:
    key, host = heartbeat_key(rank), host_token()
    latencies: list[float] = []
    bytes_sent = 0
    cpu_began = time.thread_time()
    count = 0
    next_beat = time.monotonic()
    while next_beat < until:
        count += 1
        text = Beat(count, 0, OUTSIDE, 0.0, interval, os.getpid(), host).encode()
        began = time.perf_counter()
        store.set(key, text)
        latencies.append(time.perf_counter() - began)
        bytes_sent += len(key) + len(text)
        next_beat += interval
        time.sleep(max(0.0, next_beat - time.monotonic()))
    out[rank] = {
        "beats": count,
        "latencies": latencies,
        "bytes": bytes_sent,
        "cpu_s": time.thread_time() - cpu_began,
    }


def _reader(store: Any, writers: int, interval: float, until: float, out: list[float]) -> None:
    keys = [heartbeat_key(rank) for rank in range(writers)]
    while time.monotonic() < until:
        began = time.perf_counter()
        if store.check(keys):
            store.multi_get(keys)
        out.append(time.perf_counter() - began)
        time.sleep(interval)


def measure(port: int, server_pid: int, writers: int, config: BenchConfig) -> dict[str, Any]:
    interval = beat_interval(config.timeout)
    poll = poll_interval(config.timeout, writers)
    results: dict[int, Any] = {}
    looks: list[float] = []
    # Every connection made first: 64 of them take a while on a busy machine.
    stores = [_client(port) for _ in range(writers + 1)]
    began = time.monotonic()
    until = began + config.seconds
    cpu_began = _cpu_s(server_pid)
    threads = [
        threading.Thread(target=_writer, args=(stores[rank], rank, interval, until, results))
        for rank in range(writers)
    ]
    reader = threading.Thread(target=_reader, args=(stores[-1], writers, poll, until, looks))
    threads.append(reader)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    server_cpu = _cpu_s(server_pid) - cpu_began
    latencies = sorted(latency for result in results.values() for latency in result["latencies"])
    beats = sum(result["beats"] for result in results.values())
    return {
        "writers": writers,
        "beat_interval_s": interval,
        "seconds": elapsed,
        "beats_per_s": beats / elapsed,
        "set_median_s": statistics.median(latencies),
        "set_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "bytes_per_beat": sum(result["bytes"] for result in results.values()) / beats,
        "bytes_per_s": sum(result["bytes"] for result in results.values()) / elapsed,
        "client_cpu_per_beat_s": sum(result["cpu_s"] for result in results.values()) / beats,
        "server_cpu_share": server_cpu / elapsed,
        "reader_poll_s": poll,
        "look_median_s": statistics.median(looks),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(config: BenchConfig) -> list[dict[str, Any]]:
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)])
    try:
        _client(port).set("ready", "1")  # waits until the server listens
        return [measure(port, server.pid, writers, config) for writers in config.writers]
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per writer count")
    parser.add_argument("--out", type=Path, default=Path("bench-results/heartbeat.json"))
    arguments = parser.parse_args()
    config = BenchConfig(seconds=3.0 if arguments.quick else 10.0)
    console = Console() if sys.stdout.isatty() else Console(width=120)
    load = os.getloadavg()[0]
    runs = run(config)
    table = Table(title=f"heartbeats into one TCPStore, {config.seconds:g} s per row")
    for column in (
        "writers",
        "beats/s",
        "set median",
        "set p99",
        "bytes/beat",
        "bytes/s",
        "client CPU/beat",
        "store CPU",
        "look at all",
    ):
        table.add_column(column, justify="right")
    for row in runs:
        table.add_row(
            str(row["writers"]),
            f"{row['beats_per_s']:.1f}",
            f"{row['set_median_s'] * 1e6:.0f} us",
            f"{row['set_p99_s'] * 1e6:.0f} us",
            f"{row['bytes_per_beat']:.0f}",
            f"{row['bytes_per_s']:.0f}",
            f"{row['client_cpu_per_beat_s'] * 1e6:.0f} us",
            f"{row['server_cpu_share'] * 100:.2f} %",
            f"{row['look_median_s'] * 1e6:.0f} us",
        )
    console.print(table)
    warn_if_loaded(console, load, "latencies include other processes' time")
    write_results(console, arguments.out, config, runs)


if __name__ == "__main__":
    main()
