"""The ``ddp-even`` command line: ``command.py`` parses arguments and plans (importing only
click until a command runs), ``tables.py`` prints what it planned as tables, Markdown or JSON.
"""

from ddp_even.cli.command import main

__all__ = ["main"]
