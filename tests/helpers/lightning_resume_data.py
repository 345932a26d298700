"""The Lightning resume job's data (``lightning_resume_job.py``), apart from the job so that
its test reads it without importing Lightning when the tests are collected."""

EPOCHS = 3
# Batches per rank; sample ids of rank r are r * 1000 + 0, 1, ... in batches of BATCH_SIZE,
# the last one short.
BATCHES = (9, 5)
BATCH_SIZE = 3
# The ``parquet`` source's dataset: one file of these row groups, ids 0, 1, ... in order.
# Round robin over 2 ranks gives rank 0 26 rows (9 batches) and rank 1 14 (5), as BATCHES.
PARQUET_ROW_GROUPS = [[14, 8, 12, 6]]
