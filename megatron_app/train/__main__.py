"""``python -m megatron_app.train [flags]`` — see megatron_app/train/args.py for the flags."""

from __future__ import annotations

import os
import sys

from .args import UsageError, parse_args


def _fail(message: str) -> None:
    # Every rank exits; one line per node is enough (torchrun sets LOCAL_RANK).
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"megatron_app.train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_schedule(args) -> None:
    """The schedule package's own checks (Megatron's interleaving rules, the policy's memory cap) for every rank."""
    if args.schedule == "megatron":
        return
    from megatron_app.schedule import PipelineShape, make_policy

    shape = PipelineShape(num_stages=args.pipeline_parallel, num_chunks=args.model_chunks,
                          num_microbatches=args.num_microbatches)
    policy = args.policy if args.schedule == "app" else args.schedule
    for rank in range(args.pipeline_parallel):
        make_policy(policy, shape, rank)


def check_forced_rdma(args) -> None:
    """MEGATRON_APP_TRANSPORT=rdma on a host without a usable device: one line now, before any rank starts."""
    from megatron_app.transport import TRANSPORT_ENV, rdma_status, requested_mode
    from megatron_app.transport.backends import RDMA

    try:
        mode = requested_mode()
    except ValueError as exc:  # an unknown name in the environment
        _fail(str(exc))
    if args.pipeline_parallel < 2 or mode != RDMA:
        return
    built, usable, detail = rdma_status()
    if not usable:
        _fail(f"{TRANSPORT_ENV}=rdma but this host has no usable RDMA device ({detail}); "
              "see tools/rdma_check.py, or use tcp or auto")


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
        print(f"megatron_app.train: config ok: {args.world_size} ranks, P={args.pipeline_parallel} "
              f"V={args.model_chunks} T={args.tensor_parallel} D={args.data_parallel} m={args.num_microbatches}")
        return
    # Heavy imports only once the flags are known to be good.
    from megatron_app.runtime import PipelineStallError
    from megatron_app.transport import BackendUnavailable, PeerDied, TransportTimeout

    from .loop import train

    try:
        train(args)
    except BackendUnavailable as exc:  # a forced --transport / MEGATRON_APP_TRANSPORT this job cannot honour
        _fail(str(exc))
    except (PeerDied, TransportTimeout, PipelineStallError) as exc:
        # A fault of another rank, not of this one: name it in one line instead of a traceback.
        print(f"megatron_app.train: rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
