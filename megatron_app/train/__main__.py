"""``python -m megatron_app.train [flags]`` — see megatron_app/train/args.py for the flags."""

from __future__ import annotations

import os
import sys

from megatron_app.say import say

from .args import UsageError, parse_args
from .gc_phases import pause_collections_while_importing, resume_collections


def _fail(message: str) -> None:
    # Every rank exits; one line per node is enough (torchrun sets LOCAL_RANK).
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"megatron_app.train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_schedule(args) -> None:
    """The schedule package's own checks (Megatron's interleaving rules, the policy's memory cap) for every rank."""
    if args.schedule == "megatron" or args.schedule_file is not None:   # a schedule file is checked by args.py
        return
    from megatron_app.schedule import PipelineShape, make_policy

    shape = PipelineShape(num_stages=args.pipeline_parallel, num_chunks=args.model_chunks,
                          num_microbatches=args.num_microbatches, split_backward=args.split_backward)
    for rank in range(args.pipeline_parallel):
        make_policy(args.policy, shape, rank)   # args.policy: the name of what runs (args.running_policy_name)


def check_forced_rdma(args) -> None:
    """MEGATRON_APP_TRANSPORT=rdma on a host without a usable device: one line now, before any rank starts."""
    from megatron_app.transport import TRANSPORT_ENV, requested_mode
    from megatron_app.transport.backends import RDMA

    try:
        mode = requested_mode()
    except ValueError as exc:  # an unknown name in the environment
        _fail(str(exc))
    if args.pipeline_parallel < 2 or mode != RDMA:
        return
    from megatron_app.transport import rdma_status   # the compiled core, with torch: only when RDMA is forced

    built, usable, detail = rdma_status()
    if not usable:
        _fail(f"{TRANSPORT_ENV}=rdma but this host has no usable RDMA device ({detail}); "
              "see tools/rdma_check.py, or use tcp or auto")


def check_shared_memory(args) -> None:
    """Refuse with the number when /dev/shm cannot hold this host's receive rings (Docker's default is 64 MiB)."""
    from megatron_app.transport import requested_mode

    if args.pipeline_parallel < 2 or requested_mode() in ("tcp", "rdma"):
        return
    from .shm_budget import estimate, free_and_total

    space = free_and_total()
    if space is None:
        return  # no /dev/shm to measure: the transport names what it cannot open
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    try:
        needed = estimate(args.pipeline_parallel, args.tensor_parallel, args.data_parallel, ranks_per_node, node_rank)
    except ValueError as exc:   # MEGATRON_APP_SLOT_MIB / MEGATRON_APP_SLOTS not a number in range
        _fail(str(exc))
    reason = needed.shortfall(*space)
    if reason is not None:
        _fail(reason)


def environment_failure(exc: BaseException) -> str | None:
    """The one-line text of a failure of this host's environment (no space, no permission, a port in use, a
    missing device or file), else None: a bug keeps its traceback."""
    if isinstance(exc, OSError):
        return str(exc)
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    markers = ("No space left on device", "Permission denied", "Address already in use", "No such device",
               "No such file or directory", "Operation not permitted", "Cannot allocate memory", "is /dev/shm full",
               "Read-only file system", "Disk quota exceeded")
    if isinstance(exc, RuntimeError) and any(marker in text for marker in markers):
        return first if any(marker in first for marker in markers) else f"{first} ({_marker_line(text, markers)})"
    return None


def _marker_line(text: str, markers) -> str:
    return next(line.strip() for line in text.splitlines() if any(marker in line for marker in markers))


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        _fail(str(exc))
    if args.check_config:
        try:
            check_schedule(args)
        except ValueError as exc:
            _fail(str(exc))
        check_forced_rdma(args)
        check_shared_memory(args)
        microbatches = args.num_microbatches
        if args.synthetic_plan is not None:
            counts = [len(iteration) for iteration in args.synthetic_plan.iterations]
            microbatches = f"{min(counts)}..{max(counts)} (the file's)"
        print(f"megatron_app.train: config ok: {args.world_size} ranks, P={args.pipeline_parallel} "
              f"V={args.model_chunks} T={args.tensor_parallel} D={args.data_parallel} m={microbatches}")
        return
    try:
        _train(args)
    except KeyboardInterrupt:   # before training began (imports, start-up): nothing to say beyond the terminal's ^C
        raise SystemExit(130) from None


def _train(args) -> None:
    # Heavy imports only once the flags are known to be good; megatron-core first, its fusers compiled at first use.
    from megatron_app.lazy_fusers import import_megatron_core

    import_megatron_core()
    from megatron_app.runtime import PipelineStallError
    from megatron_app.transport import BackendUnavailable, PeerDied, TransportClosed, TransportTimeout

    from .loop import train
    from .start_gate import StartGateTimeout
    from .stops import NonFiniteError, TrainingInterrupted

    resume_collections()   # torch and megatron-core are in: the model is built with the collector on
    rank = os.environ.get("RANK", "0")
    try:
        train(args)
    except TrainingInterrupted as exc:   # Ctrl-C: one line from one rank, exit status 130 as for SIGINT
        if exc.report:
            say(f"megatron_app.train: {exc}")
        raise SystemExit(130) from None
    except NonFiniteError as exc:   # every rank stops on the same iteration; one of them names it
        if exc.report:
            say(f"megatron_app.train: rank {rank}: error: {exc}")
        raise SystemExit(1) from None
    except StartGateTimeout as exc:   # its harness is gone: nothing ran yet
        say(f"megatron_app.train: rank {rank}: error: {exc}")
        raise SystemExit(1) from None
    except BackendUnavailable as exc:  # a forced --transport / MEGATRON_APP_TRANSPORT this job cannot honour
        _fail(str(exc))
    except (PeerDied, TransportClosed, TransportTimeout, PipelineStallError) as exc:
        # A fault of another rank, not of this one: name it in one line instead of a traceback.
        say(f"megatron_app.train: rank {rank}: {exc}")
        raise SystemExit(1)
    except (OSError, RuntimeError) as exc:
        reason = environment_failure(exc)
        if reason is None:
            raise
        say(f"megatron_app.train: rank {rank}: error: {reason}")
        raise SystemExit(1)


if __name__ == "__main__":
    # As a program only (an in-process caller of main() keeps its collector): before the first heavy import, and
    # its freeze at exit runs after the session's close and the exit grace, registered later.
    pause_collections_while_importing()
    main()
