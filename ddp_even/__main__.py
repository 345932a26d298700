"""``python -m ddp_even``: the ``ddp-even`` command line (:mod:`ddp_even.cli`)."""

from ddp_even.cli import main

if __name__ == "__main__":
    main()
