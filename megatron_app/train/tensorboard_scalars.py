"""--tensorboard-dir: the iteration lines' numbers as TensorBoard scalars, as Megatron-LM's training_log writes them.

Written through ``torch.utils.tensorboard.SummaryWriter`` by the reporting rank (the one that prints the iteration
lines, report.IterationReporter), one event per tag and iteration, step = the log's iteration (from 1):

  Megatron-LM's tags   'lm loss', 'learning-rate', 'grad-norm' (under --clip-grad), 'loss-scale' (--bf16 / --fp16),
                       'iteration-time' (seconds), 'batch-size' (the global batch, in samples); 'lm loss vs samples'
                       and 'learning-rate vs samples' with x = consumed samples (iteration x global batch size);
                       after an evaluation 'lm loss validation' and 'lm loss validation ppl';
  ours                 'tokens-per-second', 'peak-memory-mib', 'predicted-iteration-time' (seconds, when the
                       composition's planner predicted the iteration).

A tag is written only when its value exists; under --emulate-compute no loss is (it means nothing there). Each
iteration's events are flushed at once, so a running TensorBoard sees progress; the writer appends whole records, so
a run that dies leaves a file that reads up to its last flush. The `tensorboard` package is optional
(requirements-tensorboard.txt): it is imported only when a writer is opened.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Union

REQUIREMENTS = "requirements-tensorboard.txt"


def tensorboard_importable() -> bool:
    """Whether the `tensorboard` package is installed (found without importing it)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardScalars:
    """The scalars sink report.IterationReporter writes into: ``iteration(entry)``, ``validation(...)``, ``close()``."""

    def __init__(self, writer, global_batch_size: int, emulated: bool = False):
        """``writer``: a SummaryWriter (or anything with its add_scalar / flush / close)."""
        self._writer = writer
        self.global_batch_size = global_batch_size
        self.emulated = emulated

    @classmethod
    def open(cls, log_dir: Union[str, Path], global_batch_size: int, emulated: bool = False) -> "TensorBoardScalars":
        from torch.utils.tensorboard import SummaryWriter

        return cls(SummaryWriter(log_dir=str(log_dir)), global_batch_size, emulated)

    def iteration(self, entry: dict) -> None:
        """One iteration's JSON-log entry (report.IterationReporter.record's), then a flush."""
        step = entry["iteration"]
        samples = step * self.global_batch_size
        loss = None if self.emulated else entry.get("loss")
        predicted_ms = (entry.get("composed") or {}).get("predicted_ms")
        for tag, value, x in (
                ("lm loss", loss, step),
                ("lm loss vs samples", loss, samples),
                ("learning-rate", entry.get("lr"), step),
                ("learning-rate vs samples", entry.get("lr"), samples),
                ("grad-norm", entry.get("grad_norm"), step),
                ("loss-scale", entry.get("loss_scale"), step),
                ("iteration-time", entry["time_ms"] / 1e3, step),
                ("batch-size", self.global_batch_size, step),
                ("tokens-per-second", entry.get("tokens_per_s"), step),
                ("peak-memory-mib", entry.get("peak_memory_mib"), step),
                ("predicted-iteration-time", None if predicted_ms is None else predicted_ms / 1e3, step)):
            if value is not None:
                self._writer.add_scalar(tag, value, x)
        self._writer.flush()

    def validation(self, iteration: int, loss: float, perplexity: float) -> None:
        """An evaluation after ``iteration`` (report.IterationReporter.record_validation's numbers), then a flush."""
        self._writer.add_scalar("lm loss validation", loss, iteration)
        self._writer.add_scalar("lm loss validation ppl", perplexity, iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
