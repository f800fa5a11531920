"""Write the per-rank action lists of one of torch.distributed.pipelining's multi-stage schedules as a CSV that
megatron_app's runtime runs (--schedule-file; schedule/action_lists.py), so that torch's order and ours compare
runtime against runtime.

    python tools/torch_schedule_csv.py --schedule InterleavedZeroBubble -P 4 -V 2 -m 8 --out zb.csv

The lists come from megatron_app.bench.torch_action_lists. Bad options print one line and exit 2.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from megatron_app.bench.torch_action_lists import SCHEDULES, action_lists


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torch_schedule_csv.py", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="InterleavedZeroBubble")
    parser.add_argument("--pipeline_parallel", "--pipeline-parallel", "-P", type=int, required=True)
    parser.add_argument("--model_chunks", "--model-chunks", "-V", type=int, default=2)
    parser.add_argument("--microbatches", "-m", type=int, required=True)
    parser.add_argument("--out", required=True, help="the CSV to write (one row per pipeline rank)")
    opts = parser.parse_args(argv)
    if opts.pipeline_parallel < 2 or opts.model_chunks < 1 or opts.microbatches < 1:
        parser.error("need -P >= 2, -V >= 1 and -m >= 1")
    try:
        rows = action_lists(opts.schedule, opts.pipeline_parallel, opts.model_chunks, opts.microbatches)
    except (ValueError, RuntimeError, AssertionError) as error:
        print(f"torch_schedule_csv.py: error: torch's Schedule{opts.schedule} refuses P={opts.pipeline_parallel} "
              f"V={opts.model_chunks} m={opts.microbatches}: {str(error).splitlines()[0] if str(error) else error!r}",
              file=sys.stderr)
        return 2
    out = Path(opts.out)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    partial.replace(out)
    print(f"wrote {out}: torch Schedule{opts.schedule}, P={opts.pipeline_parallel} V={opts.model_chunks} "
          f"m={opts.microbatches}, {sum(1 for row in rows for a in row if a)} actions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
