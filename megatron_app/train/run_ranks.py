"""Run torchrun for a launcher and, when a rank fails, end with one line of our own instead of its traceback.

    python tools/run_ranks.py --name run_single.sh --log-dir LOGS [--job-id ID] -- TORCHRUN COMMAND...

The ranks' own output passes through as it comes. torchrun's agent report (its ChildFailedError traceback and
warnings) goes to LOGS/torchrun_agent_<ID>.log; on a failure the last line on stderr names the rank whose error came
first, its exit signal or code, the last iteration the job reached, that error's line, and where its log is.

Which rank: when one rank fails, the others fail soon after because of it (a peer died, a transport closed, a
collective lost its peer), and torchrun's "first observed failure" may be any of them. So a rank's own error comes
first: the trainer's one-line error ("megatron_app.train: ... error: ..."), else an exception that is not such a
consequence (its traceback's last line, also when torch.distributed prefixed every line with "[rankN]: "), the
earliest as the ranks' output arrived here; only when no rank left one, torchrun's root cause (a rank killed by a
signal). A Ctrl-C (SIGINT) ends with the ranks' own line, not a failure line: the exit status is 130. A SIGTERM
(SLURM's, to every process of the job step) is waited out too, so torchrun's and the ranks' output keeps flowing while
--exit-signal-handler saves; a run it stopped ends with 143 and one line saying so. Otherwise the exit status is
torchrun's. Standard library only: it starts before anything heavy.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_app.say import say

_RANK_LINE = re.compile(r"^\[[A-Za-z_][A-Za-z0-9_]*?(\d+)\]:")  # "[default3]:..." --tee output of local rank 3
_ITERATION = re.compile(r"\biter (\d+)/(\d+) \|")  # the trainer's per-iteration line (train/report.py)
_OWN_ERROR = re.compile(r"megatron_app\.train: (?:rank \d+: )?(?:error: )?(.*)$")
_OWN_PRIMARY = re.compile(r"megatron_app\.train: (?:rank \d+: )?error: (.*)$")   # this rank's own fault
_TRACEBACK = "Traceback (most recent call last):"
_TORCH_RANK = re.compile(r"\[rank(\d+)\]: ?$")   # torch.distributed's excepthook: "[rank3]: " before each line
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?:: (.*))?$")   # a traceback's last line: "module.Name: message"
# Exceptions that follow another rank's failure rather than cause one (the transport's, gloo's lost peers).
_CONSEQUENCES = ("TransportClosed", "PeerDied", "TransportTimeout", "PipelineStallError", "KeyboardInterrupt",
                 "SignalException")
_CONSEQUENCE_TEXT = ("Connection closed by peer", "Connection reset by peer", "closed its transport", "Broken pipe")
_INTERRUPTED = 130
_TERMINATED = 128 + signal.SIGTERM


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


def parse_failures(agent_text: str) -> dict[int, RankFailure]:
    """Every failed rank of torchrun's report (its "Failures" and "Root Cause" blocks), by local rank."""
    found = {}
    for block in re.split(r"^\s*\[\d+\]:\s*$", agent_text, flags=re.M)[1:]:
        rank = re.search(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", block, re.M)
        exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", block, re.M)
        host = re.search(r"^\s*host\s*:\s*(\S+)", block, re.M)
        if rank and exitcode:
            failure = RankFailure(int(rank.group(1)), int(rank.group(2)), host.group(1) if host else "",
                                  int(exitcode.group(1)))
            found.setdefault(failure.local_rank, failure)
    return found


@dataclass
class RankError:
    """The error line a rank left: its own (the trainer's one line), or the last line of a traceback."""

    local_rank: int
    line: str
    own: bool            # the trainer's own "error:" line: this rank's fault
    consequence: bool    # follows another rank's failure (a peer died, a transport closed)
    rank: int | None = None   # the global rank that torch's "[rankN]: " prefix named, when the traceback had one


def last_exception(lines: list[str]) -> tuple[str, int | None] | None:
    """The exception line of the last traceback in `lines`, and the rank its prefix names; None without one.

    A traceback's lines all carry the prefix its first line carries: torch.distributed's excepthook writes
    "[rankN]: " before every line of an uncaught exception (empty lines stay empty), torchrun's --tee adds
    "[defaultN]:" before that, an exception group indents its members' tracebacks with "    | ". So the prefix is
    whatever precedes "Traceback (most recent call last):"; lines without it (another process's, interleaved) are
    skipped, and the exception is the first line after the indented frames that reads "Name: message"."""
    start = next((i for i in range(len(lines) - 1, -1, -1) if _TRACEBACK in lines[i]), None)
    if start is None:
        return None
    prefix = lines[start][:lines[start].index(_TRACEBACK)]
    rank = _TORCH_RANK.search(prefix)
    for line in lines[start + 1:]:
        body = line[len(prefix):].rstrip() if line.startswith(prefix) else ""
        if body and not body[0].isspace() and _EXCEPTION.match(body):
            return body, int(rank.group(1)) if rank else None
    return None


def rank_error(local_rank: int, text: str) -> RankError | None:
    """What went wrong on one rank, from its stderr: its own error line first, else its last traceback's
    exception (torch's "[rankN]: " prefix or not), else its own line about a peer (PeerDied and the like, printed
    without "error:"). Any text is accepted: none of these found is None."""
    lines = text.splitlines()
    own = [m.group(1).strip() for line in lines if (m := _OWN_PRIMARY.search(line))]
    if own:
        return RankError(local_rank, own[-1], own=True, consequence=False)
    found = last_exception(lines)
    match = _EXCEPTION.match(found[0]) if found is not None else None
    if match is not None:
        name = match.group(1).rsplit(".", 1)[-1]
        line = f"{name}: {match.group(2)}" if match.group(2) else name
        consequence = name in _CONSEQUENCES or any(marker in line for marker in _CONSEQUENCE_TEXT)
        return RankError(local_rank, line, own=False, consequence=consequence, rank=found[1])
    peer = [m.group(1).strip() for line in lines if (m := _OWN_ERROR.search(line)) and "config ok" not in line]
    if peer:
        return RankError(local_rank, peer[-1], own=False, consequence=True)
    return None


def first_error(errors: list[RankError], arrival: dict[int, int]) -> RankError | None:
    """The error that came first: own errors before other exceptions before consequences of another rank's
    failure; within a kind, the earliest to arrive (`arrival`: local rank -> position of its first error line in
    the output as it came), then the lowest rank."""
    causes = [e for e in errors if not e.consequence]
    if not causes:
        return None
    never = len(arrival) + 1 + max(arrival.values(), default=0)
    return min(causes, key=lambda e: (not e.own, arrival.get(e.local_rank, never), e.local_rank))


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


def _rank_errors(log_dir: Path, local_ranks) -> list[RankError]:
    errors = []
    for local_rank in sorted(local_ranks):
        rank_dir = rank_log_dir(log_dir, local_rank)
        if rank_dir is None:
            continue
        try:
            text = (rank_dir / "stderr.log").read_text(encoding="utf-8", errors="replace")
        except OSError:      # none, or unreadable: the line falls back to torchrun's report
            continue
        error = rank_error(local_rank, text)
        if error is not None:
            errors.append(error)
    return errors


def nodes_of(command: list[str]) -> int:
    """torchrun's --nnodes in `command` (N, or the upper end of MIN:MAX); 1 when absent or unreadable."""
    for position, word in enumerate(command):
        value = (command[position + 1] if word == "--nnodes" and position + 1 < len(command)
                 else word.split("=", 1)[1] if word.startswith("--nnodes=") else None)
        if value is not None:
            try:
                return int(value.split(":")[-1])
            except ValueError:
                return 1
    return 1


def progress_phrase(log_dir: Path, multi_host: bool) -> str:
    """Where the run was, from this host's rank logs. The rank that prints iteration lines may live on another
    host: there, no line here says nothing about the job's progress."""
    reached = last_iteration(log_dir)
    if reached:
        return f"after iteration {reached[0]} of {reached[1]}"
    return "(no rank of this host reports iterations)" if multi_host else "before the first iteration ended"


def failure_line(name: str, log_dir: Path, agent_log: Path, agent_text: str, returncode: int,
                 arrival: dict[int, int] | None = None, multi_host: bool = False) -> str:
    """The launcher's last line: the rank whose error came first (see the module's docstring) and that error."""
    root = parse_root_cause(agent_text)
    failures = parse_failures(agent_text)
    if root is not None:
        failures.setdefault(root.local_rank, root)
    progress = progress_phrase(log_dir, multi_host)
    local_ranks = set(failures) | {int(d.name) for d in log_dir.glob("*/attempt_*/*") if d.name.isdigit()}
    first = first_error(_rank_errors(log_dir, local_ranks), arrival or {})
    failure = failures.get(first.local_rank) if first is not None else root
    if failure is None and first is not None:      # a rank that erred but is not in torchrun's report
        failure = RankFailure(first.local_rank if first.rank is None else first.rank, first.local_rank, "",
                              returncode)
    if failure is None:
        return f"{name}: the job failed (torchrun exit {returncode}) {progress}; torchrun's report: {agent_log}"
    rank_dir = rank_log_dir(log_dir, failure.local_rank)
    where = f"{rank_dir}/stderr.log" if rank_dir else str(agent_log)
    host = f" on {failure.host}" if failure.host else ""
    reason = first.line if first is not None else own_error_line(rank_dir)
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
    arrival: dict[int, int] = {}    # local rank -> position of its first error line in the ranks' output
    interrupted = []
    # The terminal's Ctrl-C reaches torchrun and the ranks directly (same process group); we only note it and wait
    # for them to finish (the ranks say where they stopped).
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    # SIGTERM likewise: dying at once would close torchrun's stderr under the ranks while they save
    terminated = []
    previous_term = signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    try:
        with open(agent_log_path, "w", encoding="utf-8") as agent_log:
            process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
            for position, line in enumerate(process.stderr):
                match = _RANK_LINE.match(line)
                if match:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                    body = line[match.end():]
                    if _OWN_PRIMARY.search(body) or _TRACEBACK in body:    # body may be "[rankN]: Traceback"
                        arrival.setdefault(int(match.group(1)), position)
                else:
                    agent_log.write(line)
                    agent_lines.append(line)
            returncode = process.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
    if returncode != 0 and interrupted:
        return _INTERRUPTED
    if returncode != 0 and terminated:
        say(f"{args.name}: stopped by SIGTERM (torchrun exit status {returncode}; the ranks' lines above say where, "
            "and --exit-signal-handler saves the iteration first)")
        return _TERMINATED
    if returncode != 0:
        say(failure_line(args.name, args.log_dir, agent_log_path, "".join(agent_lines), returncode, arrival,
                         multi_host=nodes_of(command) > 1))
        return returncode if returncode > 0 else 128 - returncode
    return 0

