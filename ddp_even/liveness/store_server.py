"""Whether the process that serves the job's store lives, when the store does not answer.

A TCP store is served by one thread of one process (global rank 0's under ``env://``,
``tcp://`` and ``torch.multiprocessing.spawn``). A store that does not answer is not a dead
or frozen host by itself: on a machine whose cores are all taken, the serving thread may wait
seconds for a core while its process runs. On this host the kernel says which: the process is
read from its heartbeat's PID when one was seen, otherwise found as the owner of the socket
listening on the store's port (``/proc/net/tcp``, ``/proc/<pid>/fd``); none listening: gone.
Elsewhere nothing is known but the store's own answers (a late one is a sign of life,
``Watch``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from ddp_even.liveness.heartbeat import tcp_store_behind
from ddp_even.liveness.peers import Watch, pid_state, process_state

__all__ = ["store_server_state"]

# TCP state "listening" in /proc/net/tcp.
_LISTEN = "0A"
# Per (host, port): whether it is this host; the PID of the process serving it here.
_local: dict[tuple[str, int], bool] = {}
_servers: dict[tuple[str, int], int | None] = {}


def store_server_state(watch: Watch, host: int | None, me: int) -> str | None:
    """``"gone"``, ``"stopped"`` or ``"running"`` for the process serving the job's store, or
    None when this host cannot tell (a store on another host, or of another kind).

    ``host`` is the global rank that hosts it (``store_host()``), ``me`` this rank: a store
    served by this very process runs whenever this code does.
    """
    if host is not None and host == me:
        return "running"
    beat = None if host is None else watch.last_beat(host)
    if beat is not None:
        return process_state(beat)
    tcp_store = tcp_store_behind(watch.origin)
    if tcp_store is None:
        return None
    key = (str(tcp_store.host), int(tcp_store.port))
    if key not in _local:
        _local[key] = _is_local(key[0])
    if not _local[key]:
        return None
    sockets = _listening(key[1])
    if not sockets:
        return "gone"  # nothing listens on the port of a store served here
    if _servers.get(key) is None:
        _servers[key] = _owner(sockets)
    pid = _servers[key]
    return None if pid is None else pid_state(pid)


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (only names that need no lookup are tried)."""
    if host in ("localhost", socket.gethostname()):
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))  # succeeds only for an address of this machine
    except OSError:
        return False
    return True


def _listening(port: int) -> set[str]:
    """The sockets listening on ``port`` here, as ``/proc/<pid>/fd`` names them."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                listening = len(fields) > 9 and fields[3] == _LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    return sockets


def _owner(sockets: set[str]) -> int | None:
    """The PID of a process holding one of ``sockets`` (None when none can be read)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in sockets:
                        return int(entry.name)
    return None
