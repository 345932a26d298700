"""moto's server, as ``python -m tests.helpers.s3_server_main ARGS`` runs it for the tests.

Two things of moto 5.2.5 (``constraints.txt``) cost the fast tests CPU time at every request
and test nothing of ours: its dispatcher lists moto's package directory to find the backend of
each request, twice (``moto.backends.list_of_moto_modules``, a third of the server's samples in
a py-spy profile of the S3 tests), and werkzeug logs every request. Here the list is made once
and the request log is off (warnings and errors still reach ``server.log``). If moto renames
the function, the patch fails at start and ``start_s3_server`` reports the server's log.
"""

from __future__ import annotations

import logging

from moto import backends
from moto.server import main

MODULES = tuple(backends.list_of_moto_modules())
backends.list_of_moto_modules = lambda: MODULES
logging.getLogger("werkzeug").setLevel(logging.WARNING)

if __name__ == "__main__":
    main()
