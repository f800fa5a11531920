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


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        _fail(str(exc))
    # Heavy imports only once the flags are known to be good.
    from .forward_backward import RuntimeUnavailable, runtime_install

    if args.schedule != "megatron":
        try:
            runtime_install()
        except RuntimeUnavailable as exc:
            _fail(str(exc))
    from .loop import train

    train(args)


if __name__ == "__main__":
    main()
