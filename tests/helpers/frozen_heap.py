"""Imported last by the ranks' fork server (``tests/helpers/spawn.py``): what it imported
leaves Python's cyclic garbage collector, in the server and in every rank forked from it.

``gc.freeze()`` moves every object alive now to a generation that collections skip. torch,
``torch._dynamo`` and ddp_even leave about 330,000 objects, which every full collection in
every rank would walk again (0.2 to 0.3 s each on the 2-core machine) though none of them is ever
garbage. Interleaved runs of six multi-rank test files: 161 and 142 s of CPU without it, 148
and 131 s with it (CONTRIBUTING.md, "Set-up and the test run").
"""

import gc

gc.freeze()
