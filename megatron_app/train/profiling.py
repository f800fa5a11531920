"""Megatron-LM's profiling flags. --profile marks training steps [--profile-step-start, --profile-step-end) of the
ranks --profile-ranks names; Megatron-LM counts steps done from 0, so start 10 and end 12 (its defaults) are the
log's iterations 11 and 12.

  --use-pytorch-profiler   torch.profiler records those iterations (CPU ops, and CUDA kernels on a GPU, with
                           shapes) and writes one Chrome/Perfetto trace per rank, ``rank<R>.<ns>.pt.trace.json.gz``
                           (gzipped, the name TensorBoard's profiler plugin reads), into --tensorboard-dir, else into
                           ``profile/`` of the run's trace directory, and beside it ``rank<R>.<ns>.ops.json``: the
                           operators with the most time of their own on the host (and their device time);
  without it (CUDA only)   the iterations are nsys's capture range: cudaProfilerStart/Stop around them and NVTX
                           ranges of autograd's ops (run under ``nsys profile --capture-range=cudaProfilerApi
                           --capture-range-end=stop``), as in Megatron-LM.

The profiler starts before its first iteration's clock and writes after its last iteration is reported, so the
iteration lines time the profiled work, not the export. A run that ends inside the range writes what was recorded.
A profiler that cannot start or write (no CUPTI on a GPU host, a full disk) says so in one line; training goes on.
A run resumed (--load) past the range profiles what is left of it, and says so when nothing is.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path
from typing import List, Optional

import torch

TOP_OPERATORS = 30   # the ops summary's length


class StepProfiler:
    def __init__(self, first: int, last: int, rank: int, out_dir: Optional[Path], cuda: bool):
        """Profiles the log's iterations first..last (1-based) of global rank ``rank``; out_dir None: nsys's range."""
        self.first, self.last, self.rank, self.out_dir, self.cuda = first, last, rank, out_dir, cuda
        self._profiler = None
        self._nvtx = None

    @classmethod
    def from_args(cls, args, rank: int, trace_dir: Optional[Path]) -> Optional["StepProfiler"]:
        if not args.profile or rank not in args.profile_ranks:
            return None
        out_dir = None
        if args.use_pytorch_profiler:
            out_dir = Path(args.tensorboard_dir) if args.tensorboard_dir else Path(trace_dir) / "profile"
        return cls(args.profile_step_start + 1, args.profile_step_end, rank, out_dir, args.device == "cuda")

    def resumed_at(self, start_iteration: int) -> Optional[str]:
        """A run that resumes after iteration ``start_iteration``: the range's first iteration may be behind it.
        Returns the line that says nothing will be profiled, or None."""
        if start_iteration >= self.last:
            return (f"profile: iterations {self.first}-{self.last} are before this run's first, "
                    f"{start_iteration + 1} (resumed): nothing profiled")
        self.first = max(self.first, start_iteration + 1)
        return None

    @property
    def running(self) -> bool:
        return self._profiler is not None or self._nvtx is not None

    def before(self, iteration: int) -> Optional[str]:
        """At the range's first iteration: start (None), or the line that says why it could not."""
        if iteration != self.first:
            return None
        try:
            self._start()
        except Exception as error:   # the profiler's own failure must not end a training run
            self._profiler = self._nvtx = None
            return f"profile: not started on rank {self.rank}: {type(error).__name__}: {error}"
        return None

    def _start(self) -> None:
        if self.out_dir is None:
            torch.cuda.cudart().cudaProfilerStart()
            nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            try:
                nvtx.__enter__()
            except Exception:
                torch.cuda.cudart().cudaProfilerStop()   # no capture range left open
                raise
            self._nvtx = nvtx
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        profiler = profile(activities=activities, record_shapes=True)
        profiler.start()
        self._profiler = profiler

    def after(self, iteration: int) -> Optional[str]:
        """At the range's last iteration: stop, write, and say where (a line for the log); else None."""
        return self.finish(iteration) if iteration == self.last and self.running else None

    def finish(self, iteration: int) -> Optional[str]:
        """Stop what is running (the range's end, or a run that ended inside it), write it, and say where."""
        try:
            return self._finish(iteration)
        except Exception as error:
            return f"profile: iterations {self.first}-{iteration} of rank {self.rank} not written: " \
                   f"{type(error).__name__}: {error}"

    def _finish(self, iteration: int) -> Optional[str]:
        if self._nvtx is not None:
            nvtx, self._nvtx = self._nvtx, None
            nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            return f"profile: iterations {self.first}-{iteration} were nsys's capture range on rank {self.rank}"
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank{self.rank}.{time.time_ns()}"
        plain, trace = stem.with_name(stem.name + ".pt.trace.json"), stem.with_name(stem.name + ".pt.trace.json.gz")
        profiler.export_chrome_trace(str(plain))
        with open(plain, "rb") as source, gzip.open(trace, "wb") as target:   # about a tenth of the JSON
            shutil.copyfileobj(source, target)
        plain.unlink()
        stem.with_name(stem.name + ".ops.json").write_text(json.dumps(
            {"iterations": [self.first, iteration], "rank": self.rank, "operators": top_operators(profiler)},
            indent=1))
        return f"profile: iterations {self.first}-{iteration} of rank {self.rank} in {trace} (ui.perfetto.dev)"


def top_operators(profiler, most: int = TOP_OPERATORS) -> List[dict]:
    """The operators (and named ranges: our tasks) with the most time of their own on the host, with their calls
    and their own device time in microseconds: where a launch-bound step's host time went."""
    averages = sorted(profiler.key_averages(), key=lambda average: average.self_cpu_time_total, reverse=True)
    return [{"name": average.key, "calls": average.count, "self_host_us": round(average.self_cpu_time_total, 1),
             "self_device_us": round(getattr(average, "self_device_time_total", 0.0), 1)}
            for average in averages[:most]]
