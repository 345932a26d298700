"""What ddp_even logs in a rank, for tests that check its messages."""

from __future__ import annotations

import logging


def ddp_even_messages(level: int = logging.INFO) -> list[str]:
    """A list that collects from now on every message ddp_even logs at ``level`` or above."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("ddp_even")
    logger.addHandler(Collect(level))
    logger.setLevel(level)
    return messages
