"""``python -m ddp_even.cli``, as ``python -m ddp_even``: the ``ddp-even`` command line."""

from ddp_even.cli.command import main

if __name__ == "__main__":
    main()
