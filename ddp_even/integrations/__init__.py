"""Glue for trainers (``ddp_even.integrations.lightning``); each submodule imports its trainer."""
