"""Start-up check of a multi-host launch (run_master.sh / run_worker.sh), before any rank starts.

The master serves a TCPStore on MASTER_PORT for a moment; every worker connects (bounded wait: a wrong address
fails with one clear line), claims its node rank (a worker started twice is named) and posts its run config; the
master compares them with its own and posts one verdict (mismatched flags are named). Then the master's store goes
away and the launchers start torchrun on the same port. Prints the job id every node must use.

    python -m megatron_app.transport.preflight --role master|worker --nnodes N --node_rank K \
        --master_addr A --master_port P --layout JSON [--job_id ID] [--timeout S] -- TRAINER_FLAGS...
Exit status 0 when the launch may go on, 2 (one line on stderr) when it must not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

PREFIX = "megatron_app/preflight"
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


def _store(args, is_master: bool):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    where = f"{args.master_addr}:{args.master_port}"
    try:
        if is_master:
            return dist.TCPStore("0.0.0.0", args.master_port, is_master=True, wait_for_workers=False,
                                 timeout=timeout)
        return dist.TCPStore(args.master_addr, args.master_port, is_master=False, timeout=timeout)
    except Exception as error:  # DistNetworkError and friends; their text is a multi-line C++ report
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if is_master:
            raise PreflightError(f"cannot serve the rendezvous on port {args.master_port} of this host "
                                 f"(in use by another job? choose --master_port): {first_line}") from None
        raise PreflightError(f"no master answered at {where} within {args.timeout:g} s (is run_master.sh "
                             f"running there, and are --master_addr/--master_port right?)") from None


def _wait(store, keys, timeout_s: float) -> bool:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return True
    except Exception:
        return False


def run_master(args, config: dict) -> str:
    store = _store(args, is_master=True)
    job_id = args.job_id
    store.set(f"{PREFIX}/config/0", json.dumps(config))
    workers = range(1, args.nnodes)
    keys = [f"{PREFIX}/config/{node}" for node in workers]
    if not _wait(store, keys, args.timeout):
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
    _wait(store, [f"{PREFIX}/ack/{node}" for node in workers], args.timeout)
    return job_id


def run_worker(args, config: dict) -> str:
    store = _store(args, is_master=False)
    if store.add(f"{PREFIX}/node/{args.node_rank}", 1) > 1:
        raise PreflightError(f"node rank {args.node_rank} has already checked in with the master at "
                             f"{args.master_addr}:{args.master_port} (is this worker started twice?)")
    store.set(f"{PREFIX}/config/{args.node_rank}", json.dumps(config))
    if not _wait(store, [f"{PREFIX}/verdict"], args.timeout):
        raise PreflightError(f"the master at {args.master_addr}:{args.master_port} gave no verdict within "
                             f"{args.timeout:g} s")
    answer = json.loads(store.get(f"{PREFIX}/verdict"))
    if answer["verdict"] != "ok":
        raise PreflightError(answer["verdict"])
    store.set(f"{PREFIX}/ack/{args.node_rank}", "1")
    # Return once the master's store is gone, so torchrun's agent never talks to it by mistake.
    _wait(store, [f"{PREFIX}/never"], args.timeout)
    return answer["job_id"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_app.transport.preflight")
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
    try:
        config = run_config(json.loads(args.layout), flags)
        job_id = run_master(args, config) if args.role == "master" else run_worker(args, config)
    except PreflightError as error:
        print(f"{args.role} node {args.node_rank}: {error}", file=sys.stderr)
        return 2
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
