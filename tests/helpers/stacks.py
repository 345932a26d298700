"""What the stack recipes' tests share (tests/test_stack_*.py, docs/stacks.md).

Every row has an ``id`` and features and a label that follow from it alone (``x0..x3``, ``y``),
so a test can rebuild any batch from the ids a rank reported, and train the same model in one
process to check what the ranks trained: :func:`reference_weights`.

- :func:`id_batches`: a rank's shard as a list of batches (dicts of tensors), for the sources
  that need no files (FSDP2, the device mesh).
- :func:`write_id_files`: the same rows as Parquet files of the given sizes (one row group each),
  for the stacks that read files (Ray Data, Hugging Face ``datasets``, ``from_parquet``).
- :func:`to_tensors`: a batch of any of these readers as ``(features, labels)``, float32.
- :class:`Seen`: what a rank trained, step by step, for the test to check.
- :func:`assert_documented`: docs/stacks.md shows a stack's recipe as the test runs it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

__all__ = [
    "FEATURES",
    "LR",
    "Seen",
    "assert_documented",
    "features_of",
    "id_batches",
    "make_model",
    "need",
    "reference_weights",
    "to_tensors",
    "write_id_files",
]

REPO = Path(__file__).resolve().parents[2]
FEATURES = ("x0", "x1", "x2", "x3")
# The label is a linear function of the features (plus a constant): a model can learn it.
_COEFFICIENTS = np.array([1.0, -2.0, 0.5, 3.0])
LR = 0.05


def features_of(ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Features ``(n, 4)`` and labels ``(n,)`` (float32) of the rows ``ids``."""
    at = np.asarray(ids, dtype=np.float64)[:, None]
    features = np.sin(at * np.arange(1, 5) * 0.37).astype(np.float32)
    labels = (features.astype(np.float64) @ _COEFFICIENTS + 0.1).astype(np.float32)
    return features, labels


def _columns(ids: np.ndarray) -> dict[str, np.ndarray]:
    features, labels = features_of(ids)
    columns: dict[str, np.ndarray] = {"id": ids.astype(np.int64)}
    columns.update({name: features[:, j] for j, name in enumerate(FEATURES)})
    columns["y"] = labels
    return columns


def id_batches(start: int, stop: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The rows ``start..stop-1`` in batches of ``batch_size`` (the last one short)."""
    return [
        {
            name: torch.from_numpy(values)
            for name, values in _columns(np.arange(at, min(at + batch_size, stop))).items()
        }
        for at in range(start, stop, batch_size)
    ]


def write_id_files(directory: Path, sizes: Sequence[int]) -> list[str]:
    """One Parquet file per size (``part-00000.parquet``, ...), rows numbered on across files;
    their paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for index, size in enumerate(sizes):
        table = pa.table(_columns(np.arange(start, start + size)))
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(table, path)
        paths.append(str(path))
        start += size
    return paths


def to_tensors(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's features ``(n, 4)`` and labels ``(n, 1)``, float32: every reader hands out
    a dict of columns (Hugging Face's collate makes float64 of Python floats)."""
    features = torch.stack([torch.as_tensor(batch[name]) for name in FEATURES], dim=1)
    labels = torch.as_tensor(batch["y"]).unsqueeze(1)
    return features.float(), labels.float()


@dataclass
class Seen:
    """One rank's epoch: per step its ids, padding flag and loss weight; the weights after."""

    ids: list[list[int]] = field(default_factory=list)
    padding: list[bool] = field(default_factory=list)
    batch_weights: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def add(self, batch: Mapping[str, Any], loader: Any) -> None:
        """The step just taken: ``batch`` from the EvenLoader ``loader``."""
        self.ids.append(torch.as_tensor(batch["id"]).tolist())
        self.padding.append(bool(loader.padding))
        self.batch_weights.append(float(loader.batch_weight))

    def real_rows(self) -> list[int]:
        """The ids of every batch that was not padding, in step order."""
        return [
            row
            for ids, padding in zip(self.ids, self.padding, strict=True)
            if not padding
            for row in ids
        ]

    def keep_weights(self, parameters: Any) -> None:
        """The model's weights, flattened in parameter order (``parameters`` as tensors)."""
        self.weights = [v for p in parameters for v in p.detach().flatten().tolist()]


def make_model() -> torch.nn.Sequential:
    """The model every stack trains, with the same initial weights in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def reference_weights(steps: Sequence[Sequence[Sequence[int]]], *, pad: bool) -> list[float]:
    """The weights, flattened in parameter order, after SGD steps on one process.

    ``steps[s][r]`` is the ids of rank ``r``'s real rows at step ``s`` (empty for padding).
    Data parallelism averages the ranks' gradients: the step's loss is the mean of each rank's
    mean squared error (truncate, cycle); in pad mode, with the loss weighted by
    ``batch_weight``, the mean over every real row of the step, whatever rank it was on.
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for ranks in steps:
        if pad:
            ids = [row for rank_ids in ranks for row in rank_ids]
            loss = _mse(model, ids)
        else:
            loss = torch.stack([_mse(model, rank_ids) for rank_ids in ranks]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [value for p in model.parameters() for value in p.detach().flatten().tolist()]


def _mse(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    features, labels = features_of(ids)
    prediction = model(torch.from_numpy(features))
    return torch.nn.functional.mse_loss(prediction, torch.from_numpy(labels).unsqueeze(1))


def need(module: str) -> Any:
    """Import ``module`` or skip the calling test module. Under CI (``CI`` set) without
    petastorm, the lane of today's stack (``scripts/test.sh --latest``, which installs the
    ``recipes`` extra), a missing module fails instead: there the recipe must run."""
    lane_without_petastorm = importlib.util.find_spec("petastorm") is None
    if not _found(module) and lane_without_petastorm and os.environ.get("CI"):
        pytest.fail(
            f"{module} is missing in the lane without petastorm: install the recipes extra "
            "(bash scripts/test.sh --latest does)",
            pytrace=False,
        )
    return pytest.importorskip(module, reason=f"{module} (the recipes extra) is not installed")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def assert_documented(section: str, sources: Sequence[Path]) -> None:
    """Every code block of docs/stacks.md's ``## section`` is an excerpt of one of ``sources``
    (whole lines, one indentation removed): the recipe a user copies is the one tested.

    The blocks are ``text``: tests/test_docs.py runs a document's ``python`` blocks in one
    process, where none of these stacks can start."""
    text = (REPO / "docs" / "stacks.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```\w*\n(.*?)^```$", body, re.S | re.M)
    assert blocks, f"docs/stacks.md's {section!r} shows no code"
    for block in blocks:
        wanted = textwrap.dedent(block).rstrip("\n").splitlines()
        if not any(_excerpt_of(wanted, source.read_text().splitlines()) for source in sources):
            names = ", ".join(str(source.relative_to(REPO)) for source in sources)
            pytest.fail(f"docs/stacks.md ({section}): not an excerpt of {names}:\n{block}")


def _excerpt_of(wanted: list[str], lines: list[str]) -> bool:
    for start, line in enumerate(lines):
        indent = line[: len(line) - len(line.lstrip())]
        if lines[start : start + len(wanted)] == [indent + want if want else "" for want in wanted]:
            return True
    return False
