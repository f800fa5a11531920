"""Run torchrun for a launcher and, when a rank fails, end with one line of our own instead of its traceback.

    python tools/run_ranks.py --name run_single.sh --log-dir LOGS [--job-id ID] -- TORCHRUN COMMAND...

The ranks' own output passes through as it comes. torchrun's agent report (its ChildFailedError traceback and
warnings) goes to LOGS/torchrun_agent_<ID>.log; on a failure the last line on stderr names the first rank that failed,
its exit signal or code, the last iteration the job reached, the rank's own last error line when it left one, and
where its log is. The exit status is torchrun's. Standard library only: it starts before anything heavy.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_RANK_LINE = re.compile(r"^\[[A-Za-z0-9_]+\d+\]:")  # "[default3]:..." --tee output of a rank
_ITERATION = re.compile(r"\biter (\d+)/(\d+) \|")  # the trainer's per-iteration line (train/report.py)
_OWN_ERROR = re.compile(r"megatron_app\.train: (?:rank \d+: )?(?:error: )?(.*)$")


@dataclass
class RankFailure:
    rank: int
    local_rank: int
    host: str
    exitcode: int

    def how(self) -> str:
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def parse_root_cause(agent_text: str) -> RankFailure | None:
    """The 'Root Cause (first observed failure)' block of torchrun's ChildFailedError report."""
    _, found, block = agent_text.partition("Root Cause")
    if not found:
        return None
    rank = re.search(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", block, re.M)
    exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", block, re.M)
    host = re.search(r"^\s*host\s*:\s*(\S+)", block, re.M)
    if not rank or not exitcode:
        return None
    return RankFailure(int(rank.group(1)), int(rank.group(2)), host.group(1) if host else "",
                       int(exitcode.group(1)))


def rank_log_dir(log_dir: Path, local_rank: int) -> Path | None:
    """torchrun writes LOG_DIR/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log: the newest such directory."""
    candidates = [d for d in log_dir.glob(f"*/attempt_*/{local_rank}") if d.is_dir()]
    return max(candidates, key=lambda d: d.stat().st_mtime) if candidates else None


def last_iteration(log_dir: Path) -> tuple[int, int] | None:
    """(iteration, of total) from the newest run's rank logs: the furthest any rank reported."""
    newest = max((d for d in log_dir.glob("*/attempt_*") if d.is_dir()), key=lambda d: d.stat().st_mtime,
                 default=None)
    best = None
    for path in sorted(newest.glob("*/std*.log")) if newest else []:
        for match in _ITERATION.finditer(path.read_text(encoding="utf-8", errors="replace")):
            found = (int(match.group(1)), int(match.group(2)))
            best = found if best is None or found[0] > best[0] else best
    return best


def own_error_line(rank_dir: Path | None) -> str | None:
    """The trainer's own one-line error, when the failed rank wrote one (the last such line of its stderr)."""
    if rank_dir is None or not (rank_dir / "stderr.log").is_file():
        return None
    found = None
    for line in (rank_dir / "stderr.log").read_text(encoding="utf-8", errors="replace").splitlines():
        match = _OWN_ERROR.search(line)
        if match and "config ok" not in line:
            found = match.group(1).strip()
    return found


def failure_line(name: str, log_dir: Path, agent_log: Path, agent_text: str, returncode: int) -> str:
    failure = parse_root_cause(agent_text)
    reached = last_iteration(log_dir)
    progress = (f"after iteration {reached[0]} of {reached[1]}" if reached else "before the first iteration ended")
    if failure is None:
        return f"{name}: the job failed (torchrun exit {returncode}) {progress}; torchrun's report: {agent_log}"
    rank_dir = rank_log_dir(log_dir, failure.local_rank)
    where = f"{rank_dir}/stderr.log" if rank_dir else str(agent_log)
    host = f" on {failure.host}" if failure.host else ""
    reason = own_error_line(rank_dir)
    because = f": {reason}" if reason else ""
    return (f"{name}: rank {failure.rank}{host} failed ({failure.how()}) {progress}{because}; its log: {where}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run_ranks.py", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the launcher's name, at the start of the failure line")
    parser.add_argument("--log-dir", required=True, type=Path, help="torchrun's --log_dir")
    parser.add_argument("--job-id", default="job", help="names the agent's log file")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="after --: the command that runs torchrun")
    args = parser.parse_args(argv)
    command = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun
    if not command:
        parser.error("no torchrun command after --")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    agent_log_path = args.log_dir / f"torchrun_agent_{re.sub(r'[^A-Za-z0-9._-]', '-', args.job_id)}.log"
    agent_lines = []
    # The terminal's Ctrl-C reaches torchrun directly (same process group); we only wait for it to finish.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open(agent_log_path, "w", encoding="utf-8") as agent_log:
            process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
            for line in process.stderr:
                if _RANK_LINE.match(line):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    agent_log.write(line)
                    agent_lines.append(line)
            returncode = process.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    if returncode != 0:
        print(failure_line(args.name, args.log_dir, agent_log_path, "".join(agent_lines), returncode), file=sys.stderr, flush=True)
        return returncode if returncode > 0 else 128 - returncode
    return 0

