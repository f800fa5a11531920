"""Per-iteration loss reduction, the log line and the JSON log.

The loss is Megatron's 'lm loss': per-microbatch [loss_sum, num_tokens] pairs summed over the
microbatches and the data-parallel group, then divided (a token-weighted mean; with the default
all-ones loss mask it equals the mean over microbatches).
"""

from __future__ import annotations

import json
import math
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state

LOG_SCHEMA = "megatron_app.train.log/1"


def reduce_lm_loss(losses_reduced: List[dict]) -> Optional[float]:
    """Global-batch loss on last-stage ranks (collective over the DP group); None elsewhere."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    if not losses_reduced:
        raise RuntimeError("the forward_backward function returned no losses on the last pipeline stage")
    total = torch.stack([entry["lm loss"].float() for entry in losses_reduced]).sum(dim=0)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item()


def is_reporting_rank() -> bool:
    """Last pipeline stage, first tensor- and data-parallel rank."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def write_json_atomic(path: str, payload: dict) -> None:
    """Readers never see a half-written file: write a sibling then rename over."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(tmp, path)


class IterationReporter:
    """Prints one line every ``log_interval`` iterations (Megatron-LM's --log-interval) and keeps the JSON log up to
    date with every iteration (reporting rank only)."""

    def __init__(self, run_config: dict, iters: int, tokens_per_iteration: int,
                 log_json: Optional[str], emulated: bool = False, shows_lr: bool = False, log_interval: int = 1,
                 scalars=None):
        """``emulated``: --emulate-compute replaced the model by timed waits, so the loss means nothing: the line
        says so instead of printing it (the JSON log keeps the number, marked "emulated"). ``shows_lr``: the
        learning rate varies (a schedule): the line shows each step's. ``scalars``: where each iteration's entry and
        each validation also go, flushed as they come (--tensorboard-dir: tensorboard_scalars.TensorBoardScalars;
        its ``iteration(entry)``, ``validation(iteration, loss, ppl)`` and ``close()``); closed by close()."""
        self.enabled = is_reporting_rank()
        self.iters = iters
        self.tokens_per_iteration = tokens_per_iteration
        self.log_json = log_json
        self.emulated = emulated
        self.shows_lr = shows_lr
        self.log_interval = log_interval
        self.scalars = scalars
        self._interval: List[dict] = []   # the JSON entries of the iterations since the last line
        self.payload = {"schema": LOG_SCHEMA, "config": run_config, "iterations": [], "validation": []}
        if emulated:
            self.payload["emulated"] = True

    def record(self, iteration: int, loss: Optional[float], seconds: float, tokens: Optional[int] = None,
               composed: Optional[dict] = None, optimizer: Optional[dict] = None) -> None:
        """``tokens``: the iteration's tokens when they vary (variable-length samples), else the fixed count.
        ``composed``: the planned microbatches when the loop composed them (num_microbatches, microbatch_tokens,
        padding_tokens, composition), kept in the JSON log. ``optimizer``: the step's learning rate ("lr"), the
        gradients' norm before clipping under --clip-grad ("grad_norm"), under --bf16 / --fp16 the loss scale and the
        iterations skipped for overflowing gradients (the optimizer's report), shown as Megatron-LM does."""
        if not self.enabled:
            return
        tokens_per_s = (self.tokens_per_iteration if tokens is None else tokens) / seconds
        entry = {"iteration": iteration, "loss": loss, "time_ms": seconds * 1e3, "tokens_per_s": tokens_per_s,
                 **({} if composed is None else {"composed": composed}), **(optimizer or {})}
        self.payload["iterations"].append(entry)
        self._interval.append(entry)
        if self.scalars is not None:
            self.scalars.iteration(entry)
        if iteration % self.log_interval == 0 or iteration == self.iters:
            self.flush()
        self._write()

    def flush(self) -> None:
        """The line of the iterations recorded since the last one (none: nothing), as Megatron-LM's: the loss and
        the time per iteration averaged over them, the tokens per second of them all, the last step's learning
        rate, gradient norm and loss scale."""
        entries, self._interval = self._interval, []
        if not entries:
            return
        last, count = entries[-1], len(entries)
        time_ms = sum(entry["time_ms"] for entry in entries) / count
        tokens_per_s = sum(entry["tokens_per_s"] * entry["time_ms"] for entry in entries) / (time_ms * count)
        if self.emulated:
            shown = "emulated compute, no real loss"
        else:   # as Megatron-LM: the iterations that stepped (an overflow's loss may be inf), else all
            counted = [entry for entry in entries if not entry.get("skipped")] or entries
            shown = f"loss {sum(entry['loss'] for entry in counted) / len(counted):.4f}"
            if len(counted) > 1:
                shown += f" (mean of {len(counted)})"
        planned = ""
        composed = last.get("composed")
        if composed is not None:
            planned = f" | {composed['composition']} {composed['num_microbatches']} microbatches"
            predicted = [entry["composed"]["predicted_ms"] for entry in entries
                         if entry.get("composed", {}).get("predicted_ms") is not None]
            if predicted:
                planned += f" | predicted {sum(predicted) / len(predicted):.1f} ms"
        if self.shows_lr and last.get("lr") is not None:
            planned += f" | lr {last['lr']:.3e}"
        if last.get("grad_norm") is not None:
            planned += f" | grad norm {last['grad_norm']:.4g}"
        if "loss_scale" in last:
            skipped_now = sum(1 for entry in entries if entry.get("skipped"))
            planned += f" | loss scale {last['loss_scale']:g} | skipped iterations {last['skipped_iterations']}"
            if skipped_now:
                planned += (" (this one: gradients overflowed)" if count == 1
                            else f" ({skipped_now} of these {count}: gradients overflowed)")
        print(f"iter {last['iteration']}/{self.iters} | {shown} | {time_ms:.1f} ms | "
              f"{tokens_per_s:.0f} tokens/s{planned}", flush=True)

    def record_startup(self, startup: Optional[dict]) -> None:
        """The rank's start-up phases (startup.StartupClock.report), kept in the JSON log as "startup"."""
        if self.enabled and startup is not None:
            self.payload["startup"] = startup
            self._write()

    def record_ending(self, ending: Optional[dict]) -> None:
        """The rank's loop, closing and process-group teardown (startup.EndingClock.report), kept as "ending"."""
        if self.enabled and ending is not None:
            self.payload["ending"] = ending
            self._write()

    def record_validation(self, iteration: int, loss: Optional[float]) -> None:
        if not self.enabled:
            return
        perplexity = math.exp(min(loss, 700.0))
        print(f"validation at iter {iteration} | loss {loss:.4f} | ppl {perplexity:.2f}", flush=True)
        self.payload["validation"].append({"iteration": iteration, "loss": loss, "ppl": perplexity})
        if self.scalars is not None:
            self.scalars.validation(iteration, loss, perplexity)
        self._write()

    def close(self) -> None:
        """The end of the run: close the scalars' sink (its last events are on disk once this returns)."""
        scalars, self.scalars = self.scalars, None
        if scalars is not None:
            scalars.close()

    def note(self, text: str) -> None:
        """One line for the user (resume, checkpoint, early exit)."""
        if self.enabled:
            print(f"megatron_app.train: {text}", flush=True)

    def _write(self) -> None:
        if self.log_json:
            write_json_atomic(self.log_json, self.payload)
