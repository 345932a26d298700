"""PyTorch Lightning callbacks: :class:`EvenLoaderStats` logs every epoch's
:class:`~ddp_even.EpochStats` to the trainer's loggers, :class:`EvenLoaderCheckpoints` saves the
step Lightning resumes at (docs/trainers.md: an :class:`~ddp_even.EvenLoader` goes to a
``Trainer(strategy="ddp")`` as it is, in every mode but join). This is the only module of
ddp_even that imports Lightning (``lightning.pytorch``).

Lightning internals relied on (lightning 2.6, pinned in ``constraints.txt``):
``lightning.pytorch.loops.progress._ProcessedTracker`` and the fit loop's
``epoch_loop.batch_progress`` (its ``ready``/``started``/``processed``/``completed`` counts and
``is_last_batch``): where Lightning restarts a resumed fit, for :class:`EvenLoaderCheckpoints`
(a Lightning without them is left be). ``tests/test_lightning_resume.py`` fails first if they
change.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops.progress import _ProcessedTracker

from ddp_even.liveness.gradient_hook import register_on
from ddp_even.loader import EvenLoader
from ddp_even.resume.state import STATE_FORMAT
from ddp_even.runtime.stats import EpochStats

__all__ = ["EvenLoaderCheckpoints", "EvenLoaderStats", "find_even_loaders", "stats_metrics"]

logger = logging.getLogger("ddp_even")


def stats_metrics(stats: EpochStats, prefix: str = "ddp_even/") -> dict[str, float]:
    """One epoch's statistics as flat numbers for a metrics logger.

    Per-rank fields are summed over the ranks (``steps`` as min and max); fields that are not
    known (``samples`` and the other ``*_rows`` with unsized batches, ``dropped_*`` and
    ``lost_rows`` without a shard plan, ``resumed_at_step`` in an epoch that was not resumed)
    are left out.

    Example::

        >>> from ddp_even import EvenLoader
        >>> loader = EvenLoader([[1, 2], [3]], mode="cycle", steps_per_epoch=3)
        >>> _ = list(loader)
        >>> stats_metrics(loader.stats)  # doctest: +NORMALIZE_WHITESPACE
        {'ddp_even/epoch': 0, 'ddp_even/steps_min': 3, 'ddp_even/steps_max': 3,
         'ddp_even/own_batches': 2, 'ddp_even/repeated_batches': 1, 'ddp_even/passes_max': 2,
         'ddp_even/truncated_ranks': 0, 'ddp_even/empty_ranks': 0, 'ddp_even/oversampling': 0.5,
         'ddp_even/padded_batches': 0, 'ddp_even/sent_batches': 0, 'ddp_even/received_batches': 0,
         'ddp_even/steps_saved': 0, 'ddp_even/samples': 5, 'ddp_even/padded_rows': 0,
         'ddp_even/sent_rows': 0, 'ddp_even/received_rows': 0}
    """
    metrics: dict[str, float] = {
        "epoch": stats.epoch,
        "steps_min": min(stats.steps, default=0),
        "steps_max": max(stats.steps, default=0),
        "own_batches": sum(stats.own_batches),
        "repeated_batches": sum(stats.repeated_batches),
        "passes_max": max(stats.passes, default=0),
        "truncated_ranks": sum(stats.truncated),
        "empty_ranks": len(stats.empty_ranks),
        "oversampling": stats.oversampling,
        "padded_batches": sum(stats.padded_batches),
        "sent_batches": sum(stats.sent_batches),
        "received_batches": sum(stats.received_batches),
        "steps_saved": stats.steps_saved,
    }
    for name in ("samples", "padded_rows", "sent_rows", "received_rows"):
        rows: tuple[int | None, ...] = getattr(stats, name)
        if None not in rows:
            metrics[name] = sum(count for count in rows if count is not None)
    for name in ("dropped_batches", "dropped_rows", "lost_rows"):
        per_rank: tuple[int, ...] | None = getattr(stats, name)
        if per_rank is not None:
            metrics[name] = sum(per_rank)
    if stats.resumed_at_step is not None:
        metrics["resumed_at_step"] = stats.resumed_at_step
    return {prefix + name: value for name, value in metrics.items()}


def find_even_loaders(dataloaders: object) -> dict[str, EvenLoader[Any]]:
    """The EvenLoaders in what a trainer holds, by name: ``""`` alone, else key or list index.

    ``dataloaders`` is what ``trainer.train_dataloader`` returns: one loader, or a list or dict
    of them (nested as Lightning's ``CombinedLoader`` allows).

    Example::

        >>> from ddp_even import EvenLoader
        >>> loader = EvenLoader([[1], [2]])
        >>> find_even_loaders(loader) == {"": loader}
        True
        >>> sorted(find_even_loaders({"a": loader, "b": [[3]], "c": [loader]}))
        ['a', 'c/0']
    """
    return dict(_walk(dataloaders, ""))


def _walk(node: object, name: str) -> Iterator[tuple[str, EvenLoader[Any]]]:
    if isinstance(node, EvenLoader):
        yield name, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk(value, f"{name}/{key}" if name else str(key))
    elif isinstance(node, Sequence) and not isinstance(node, str | bytes):
        for index, value in enumerate(node):
            yield from _walk(value, f"{name}/{index}" if name else str(index))


class EvenLoaderStats(Callback):
    """Logs the statistics of the trainer's EvenLoader(s) to its loggers after each train epoch.

    At ``on_train_epoch_end`` (every rank) the callback takes the :class:`~ddp_even.EpochStats`
    of the epoch that just ran from each EvenLoader in ``trainer.train_dataloader``, turns them
    into numbers with :func:`stats_metrics` and passes them to every logger in
    ``trainer.loggers`` (Lightning's loggers write on global rank 0 only), at the step Lightning
    logs its own epoch-end metrics at. Several loaders get their name in the key
    (``ddp_even/<name>/steps_max``). The statistics are equal on every rank, so nothing is
    reduced; ``metrics`` keeps what was logged, on every rank.

    At ``on_fit_start`` it makes the DDP model Lightning wrapped average its gradients through
    :func:`~ddp_even.allreduce_hook` (unless the model has a communication hook of its own:
    ``DDPStrategy(ddp_comm_hook=...)``), so that a rank that dies inside ``backward()`` is named
    on every survivor, as ``DDPStrategy(ddp_comm_hook=allreduce_hook)`` would do on CUDA only.

    When Lightning knows the loader's length (``EvenLoader.from_parquet``) it stops after the
    last batch, leaving the loader's epoch open: the callback closes it with ``iter(loader)``
    (every rank reaches this hook at the same point), so that the last epoch is logged too.

    Args:
        prefix: the start of every metric name.

    Attributes:
        metrics: what was logged, one dict per train epoch that had statistics.

    Example, on every rank (``examples/train_lightning.py`` is the whole script)::

        class Regression(lightning.pytorch.LightningModule):
            ...

            def train_dataloader(self):  # called once the process group exists
                return EvenLoader.from_parquet(url, batch_size=64, mode="cycle")

        trainer = lightning.pytorch.Trainer(
            accelerator="cpu", devices=4, strategy="ddp", max_epochs=3,
            logger=CSVLogger("logs"), callbacks=[EvenLoaderStats()],
        )
        trainer.fit(Regression())
        # logs/lightning_logs/version_0/metrics.csv: ddp_even/steps_max, ddp_even/oversampling, ...
    """

    def __init__(self, prefix: str = "ddp_even/") -> None:
        super().__init__()
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        self.prefix = prefix
        self.metrics: list[dict[str, float]] = []
        # The statistics last logged for each loader.
        self._logged: weakref.WeakKeyDictionary[EvenLoader[Any], EpochStats] = (
            weakref.WeakKeyDictionary()
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        register_on(trainer.strategy.model)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loaders = find_even_loaders(trainer.train_dataloader)
        metrics: dict[str, float] = {}
        for name, loader in loaders.items():
            stats = self._new_stats(loader)
            if stats is None:
                logger.debug(
                    "epoch %d: EvenLoader %r has no statistics for this epoch (it ended early)",
                    trainer.current_epoch,
                    name,
                )
                continue
            metrics.update(stats_metrics(stats, f"{self.prefix}{name}/" if name else self.prefix))
        if not metrics:
            return
        self.metrics.append(metrics)
        # Lightning logs its own epoch-end metrics at the step of the epoch's last batch; the
        # same step keeps step-ordered loggers from seeing a step go backwards.
        step = max(trainer.global_step - 1, 0)
        for metrics_logger in trainer.loggers:
            metrics_logger.log_metrics(metrics, step=step)

    def _new_stats(self, loader: EvenLoader[Any]) -> EpochStats | None:
        """The statistics of the epoch that just ran, if it ran to its end."""
        iter(loader)  # closes an epoch left open (see the class); starts nothing
        if not loader.history or loader.history[-1] is self._logged.get(loader):
            return None
        self._logged[loader] = loader.history[-1]
        return loader.history[-1]


class EvenLoaderCheckpoints(Callback):
    """Saves, as each EvenLoader's position in a checkpoint, the step Lightning resumes at.

    Lightning stores ``loader.state_dict()`` in its checkpoints and restores it with
    ``load_state_dict`` (an EvenLoader is a stateful dataloader to it). Two things make the
    loader's own position differ from Lightning's: its fetcher reads one batch ahead when
    ``len(loader)`` is not known yet (the loader has then handed out one batch more than was
    trained on), and after an epoch's last batch Lightning counts the epoch as done while the
    loader, asked for nothing more, still holds it open. Without this callback a resumed fit
    can skip a batch or a whole epoch; with it, the resumed fit trains on exactly the batches
    the uninterrupted one would have (tested in truncate and cycle, mid-epoch and at an
    epoch's end).

    Example::

        trainer = Trainer(strategy="ddp", callbacks=[EvenLoaderCheckpoints(), EvenLoaderStats()])
        trainer.fit(module, ckpt_path="last.ckpt")
    """

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        current = progress.current
        if not isinstance(current, _ProcessedTracker):  # another Lightning: leave it be
            return
        # Lightning restarts after the last completed batch, or after the batch whose
        # on_train_batch_end is running (as its training epoch loop's reset works it out).
        done = current.completed
        if current.ready == current.started == current.processed == current.completed + 1:
            done += 1
        epoch, step = trainer.current_epoch, done
        if progress.is_last_batch and done == current.ready:  # the epoch's last batch is done
            epoch, step = epoch + 1, 0
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        for state in fit_state.get("combined_loader", []):
            if isinstance(state, dict) and state.get("format") == STATE_FORMAT:
                state["epoch"], state["step"] = epoch, step
