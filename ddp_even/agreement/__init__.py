"""The agreement between ranks: what each rank says (``wire.py``), the collectives that carry
it (``transport.py``) and the gloo group they run on (``control_group.py``).
Whether the peers are alive is :mod:`ddp_even.liveness`'s."""
