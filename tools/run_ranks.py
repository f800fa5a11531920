#!/usr/bin/env python3
"""Run torchrun for a launcher and, when a rank fails, end with one line of our own instead of its traceback.

    python tools/run_ranks.py --name run_single.sh --log-dir LOGS [--job-id ID] -- TORCHRUN COMMAND...

The ranks' own output passes through as it comes. torchrun's agent report (its ChildFailedError traceback and
warnings) goes to LOGS/torchrun_agent_<ID>.log; on a failure the last line on stderr names the first rank that failed,
its exit signal or code, the last iteration the job reached, the rank's own last error line when it left one, and
where its log is. The exit status is torchrun's. Standard library only: it starts before anything heavy.
"""

import sys

from megatron_app.train.run_ranks import main

if __name__ == "__main__":
    sys.exit(main())
