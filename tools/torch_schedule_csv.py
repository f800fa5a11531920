"""Write the per-rank action lists of one of torch.distributed.pipelining's multi-stage schedules as a CSV that
megatron_app's runtime runs (--schedule-file; schedule/action_lists.py), so that torch's order and ours compare
runtime against runtime.

    python tools/torch_schedule_csv.py --schedule InterleavedZeroBubble -P 4 -V 2 -m 8 --out zb.csv

The lists come from megatron_app.bench.torch_action_lists. Bad options print one line and exit 2.
"""

import sys

from megatron_app.bench.torch_action_lists import main

if __name__ == "__main__":
    sys.exit(main())
