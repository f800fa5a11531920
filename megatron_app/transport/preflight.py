"""Start-up check of a multi-host launch (run_master.sh / run_worker.sh), before any rank starts.

The master serves a TCPStore on MASTER_PORT for a moment; every worker connects (bounded wait: a wrong address
fails with one clear line), claims its node rank (a worker started twice is named) and posts its run config; the
master compares them with its own and posts one verdict (mismatched flags are named). Then the master's store goes
away and the launchers start torchrun on the same port. Prints the job id every node must use.

    python megatron_app/transport/preflight.py --role master|worker --nnodes N --node_rank K \
        --master_addr A --master_port P --layout JSON [--job_id ID] [--timeout S] -- TRAINER_FLAGS...
Exit status 0 when the launch may go on, 2 (one line on stderr) when it must not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import threading
import time

PREFIX = "megatron_app/preflight"
# The master posts its config as soon as its store is up: a store at the master's address without it is not the
# check-in store but a job already running there (torchrun's store takes the port once the check-in is over).
MASTER_CONFIG_GRACE_S = 2.0
# Beyond --timeout, the most any step may add (a store call that does not return) before the watchdog ends us.
WATCHDOG_SLACK_S = 3.0
CONNECT_ATTEMPT_S = 1.0
# Flags that name files on each host's own disk: they may differ between hosts without changing the run.
HOST_LOCAL_FLAGS = {"--log-json", "--trace-dir", "--dump-grads", "--dump-weights"}


class PreflightError(RuntimeError):
    """The launch must not go on; the message is one line for the user."""


def run_config(layout: dict, trainer_flags: list[str]) -> dict:
    """What every host must agree on: the layout plus each trainer flag and its values (host-local paths left
    out; `--a_b` and `--a-b` are one flag)."""
    config = {key: str(value) for key, value in layout.items()}
    flag = None
    for token in trainer_flags:
        if token.startswith("--"):
            name, _, value = token.partition("=")
            flag = name.replace("_", "-")
            config[flag] = value
        elif flag is not None:
            config[flag] = (config[flag] + " " + token).strip()
        else:
            config.setdefault("(arguments)", "")
            config["(arguments)"] = (config["(arguments)"] + " " + token).strip()
    for name in HOST_LOCAL_FLAGS:
        config.pop(name, None)
    return config


def describe_mismatch(master: dict, worker: dict, node_rank: int) -> str:
    """'' when the two run configs agree, else which settings differ and how."""
    differences = []
    for key in sorted(set(master) | set(worker)):
        if master.get(key) != worker.get(key):
            differences.append(f"{key}: master {master.get(key)!r}, node {node_rank} {worker.get(key)!r}")
    return "; ".join(differences)


class Deadline:
    """One bound for the whole check-in: every wait gets what is left of --timeout, not --timeout again."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def extend(self, seconds: float) -> None:
        """Time spent on our own work (importing torch on a loaded host) is not waiting for the other side."""
        self._end += seconds


def _store(args, is_master: bool, deadline: Deadline):
    where = f"{args.master_addr}:{args.master_port}"
    # A worker probes with a plain socket first, before importing torch (seconds on a loaded host): the store
    # client's own connect retries run on their own schedule, far past its timeout when nobody listens.
    if not is_master and not _port_answers(args.master_addr, args.master_port, deadline):
        raise PreflightError(f"no master answered at {where} within {args.timeout:g} s (is run_master.sh "
                             f"running there, and are --master_addr/--master_port right?)")
    importing = time.monotonic()
    import torch.distributed as dist

    deadline.extend(time.monotonic() - importing)
    _start_watchdog(args, deadline)
    try:
        if is_master:
            return dist.TCPStore("0.0.0.0", args.master_port, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=max(1.0, deadline.left())))
        return dist.TCPStore(args.master_addr, args.master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=max(1.0, deadline.left())))
    except PreflightError:
        raise
    except Exception as error:  # DistNetworkError and friends; their text is a multi-line C++ report
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if is_master:
            raise PreflightError(f"cannot serve the rendezvous on port {args.master_port} of this host "
                                 f"(in use by another job? choose --master_port): {first_line}") from None
        raise PreflightError(f"no master answered at {where} within {args.timeout:g} s (is run_master.sh "
                             f"running there, and are --master_addr/--master_port right?)") from None


def _port_answers(host: str, port: int, deadline: Deadline) -> bool:
    """Whether something accepts connections at host:port before the deadline (tries about twice a second)."""
    while True:
        attempt_s = min(CONNECT_ATTEMPT_S, deadline.left())
        if attempt_s <= 0:
            return False
        started = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=attempt_s):
                return True
        except OSError:
            time.sleep(max(0.0, min(0.5 - (time.monotonic() - started), deadline.left())))


def _start_watchdog(args, deadline: Deadline) -> None:
    """Ends the process with one line if a store call overruns the bound: a hard guarantee for the launchers."""
    def give_up() -> None:
        print(f"{args.role} node {args.node_rank}: gave up: the check-in with {args.master_addr}:{args.master_port} "
              f"overran --rendezvous_timeout {args.timeout:g} s by {WATCHDOG_SLACK_S:g} s (a store call that did not "
              f"return)", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(deadline.left() + WATCHDOG_SLACK_S, give_up)
    timer.daemon = True
    timer.start()


def _wait(store, keys, timeout_s: float) -> bool:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return True
    except Exception:
        return False


def run_master(args, config: dict, deadline: Deadline) -> str:
    store = _store(args, is_master=True, deadline=deadline)
    job_id = args.job_id
    store.set(f"{PREFIX}/config/0", json.dumps(config))
    workers = range(1, args.nnodes)
    keys = [f"{PREFIX}/config/{node}" for node in workers]
    if not _wait(store, keys, deadline.left()):
        missing = [node for node in workers if not store.check([f"{PREFIX}/config/{node}"])]
        verdict = f"worker node(s) {missing} did not check in within {args.timeout:g} s"
    else:
        problems = []
        for node in workers:
            mismatch = describe_mismatch(config, json.loads(store.get(f"{PREFIX}/config/{node}")), node)
            if mismatch:
                problems.append(mismatch)
        verdict = ("flags differ between hosts: " + " | ".join(problems)) if problems else "ok"
    store.set(f"{PREFIX}/verdict", json.dumps({"verdict": verdict, "job_id": job_id}))
    if verdict != "ok":
        _wait(store, [f"{PREFIX}/never"], 2.0)  # give checked-in workers a moment to read why
        raise PreflightError(verdict)
    # Keep the store up until every worker has read the verdict.
    # At least a moment, so a worker that checked in at the last second can still read it (within the slack).
    _wait(store, [f"{PREFIX}/ack/{node}" for node in workers], max(MASTER_CONFIG_GRACE_S, deadline.left()))
    return job_id


def run_worker(args, config: dict, deadline: Deadline) -> str:
    store = _store(args, is_master=False, deadline=deadline)
    if not _wait(store, [f"{PREFIX}/config/0"], min(MASTER_CONFIG_GRACE_S, deadline.left())):
        raise PreflightError(f"a job is already running with the master at {args.master_addr}:"
                             f"{args.master_port} (its store is not run_master.sh's check-in): is this worker "
                             f"(node rank {args.node_rank}) started twice, or does another job use the port?")
    if store.add(f"{PREFIX}/node/{args.node_rank}", 1) > 1:
        raise PreflightError(f"node rank {args.node_rank} has already checked in with the master at "
                             f"{args.master_addr}:{args.master_port} (is this worker started twice?)")
    store.set(f"{PREFIX}/config/{args.node_rank}", json.dumps(config))
    if not _wait(store, [f"{PREFIX}/verdict"], deadline.left()):
        raise PreflightError(f"the master at {args.master_addr}:{args.master_port} gave no verdict within "
                             f"{args.timeout:g} s")
    answer = json.loads(store.get(f"{PREFIX}/verdict"))
    if answer["verdict"] != "ok":
        raise PreflightError(answer["verdict"])
    store.set(f"{PREFIX}/ack/{args.node_rank}", "1")
    # Return once the master's store is gone, so torchrun's agent never talks to it by mistake.
    _wait(store, [f"{PREFIX}/never"], deadline.left())
    return answer["job_id"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_app/transport/preflight.py")
    parser.add_argument("--role", choices=("master", "worker"), required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node_rank", type=int, required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--layout", required=True, help="the launcher's own settings as a JSON object")
    parser.add_argument("--job_id", default="")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("trainer_flags", nargs=argparse.REMAINDER, help="after --: the trainer's flags")
    args = parser.parse_args(argv)
    flags = args.trainer_flags[1:] if args.trainer_flags[:1] == ["--"] else args.trainer_flags
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d's retry chatter is not for the user
    deadline = Deadline(args.timeout)
    try:
        config = run_config(json.loads(args.layout), flags)
        run = run_master if args.role == "master" else run_worker
        job_id = run(args, config, deadline)
    except PreflightError as error:
        print(f"{args.role} node {args.node_rank}: {error}", file=sys.stderr)
        return 2
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
