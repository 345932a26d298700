"""Whether the peers are alive, apart from what the ranks agree on: each process's heartbeat
(``heartbeat.py``), the peers' heartbeats judged while a rank waits and the verdict shared
(``peers.py``), who was missing when a collective failed (``rollcall.py``), the failure paths'
verdicts (``verdict.py``), and a peer lost inside DDP's own gradient all-reduce named
(``gradient_hook.py``, :func:`~ddp_even.allreduce_hook`).
"""
