"""The training function the TorchDistributor tests hand to ``TorchDistributor.run``.

It runs in every rank that ``torchrun`` starts (on the driver with ``local_mode=True``, in a
Spark barrier task per rank with ``local_mode=False``), takes rank and world size from the
process group made from the environment TorchDistributor set, trains one epoch per ddp_even
mode over a converter, and returns what every rank saw. The tests pickle it by value
(``pyspark.cloudpickle.register_pickle_by_value``), so the ranks need no ``tests`` package on
their path; it imports what it uses inside.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train_every_mode"]


def train_every_mode(converter: Any, modes: list[str], batch_size: int) -> list[dict[str, Any]]:
    """One epoch in each of ``modes`` over ``converter``; every rank's report, on every rank.

    TorchDistributor's local mode returns the value of whichever rank writes its output file
    last (every rank writes the same file), so every rank returns the same list: the reports
    of all ranks, gathered.
    """
    import os
    import warnings

    import torch
    import torch.distributed as dist

    from ddp_even import EvenLoader
    from ddp_even.petastorm.spark_converter import ConverterSource

    # petastorm 0.12.1 drives pyarrow 14 through its deprecated API and hands torch
    # read-only arrays: a dozen warnings per reader in the job's output.
    warnings.simplefilter("ignore", FutureWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def fit() -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        report: dict[str, Any] = {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "env": {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
            "pid": os.getpid(),
            "modes": {},
        }
        for mode in modes:
            source = ConverterSource(converter, batch_size=batch_size, workers_count=2)
            loader = EvenLoader(
                source, mode, joinables=[model] if mode == "join" else (), timeout=60
            )
            batches: list[list[int]] = []
            padding: list[bool] = []
            for batch in loader:
                # batch_weight is 1.0 but in pad mode, where padding weighs 0.
                loss = (
                    model(batch["value"].float().reshape(-1, 1)).pow(2).mean() * loader.batch_weight
                )
                padding.append(loader.padding)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                batches.append([int(i) for i in batch["id"]])
            report["modes"][mode] = {
                "batches": batches,
                "padding": padding,
                "stats": loader.stats.as_dict(),
                "weights": [param.item() for param in model.module.parameters()],
            }
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        return reports

    dist.init_process_group("gloo")
    try:
        return fit()
    finally:  # fit's model is freed by now (docs/using.md, "Ending a job")
        dist.destroy_process_group()
