"""Whether the peers are alive, apart from what the ranks agree on: each process's heartbeat in
the job's store (``heartbeat.py``), the peers' heartbeats judged while a rank waits (dead,
stalled or busy: ``peers.py``), who was missing when a collective failed (``rollcall.py``), the
verdict every rank raises (``verdict.py``), and a peer lost inside DDP's own gradient
all-reduce named (``gradient_hook.py``, :func:`~ddp_even.allreduce_hook`).
"""
