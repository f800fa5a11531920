"""A user's own training script that our refusal, or another rank's failure, stops ends in one line, not a traceback.

Our refusals (a misbuilt model at the first call, a bad install() argument) are AppConfigErrors whose message names
the rank and the fix, and an untested megatron-core is an UnsupportedMegatronError naming the way out; the frames
above them are our runtime's and Megatron's, of no use to the user. install_excepthook() puts, once per process, a
hook in front of the interpreter's: an uncaught refusal is printed as

    megatron_app: rank 1: AppConfigError: pipeline rank 1's model chunk 0 (...) was built with pre_process=True; ...

So is another rank's failure: the transport's PeerDied, TransportClosed and TransportTimeout, the runtime's
PipelineStallError, and a collective of the user's loop that met a dead peer (gloo's "Connection reset by peer"),
printed as the PeerDied naming that peer once the transport has seen it go (peer_gone.py). The process exits with
status 1 as after any uncaught exception (the interpreter's rule: a hook only prints). Any other exception goes to
the hook that was there before (Python's, or torch.distributed's, which prefixes each line with "[rankN]: "),
unchanged. torch.distributed.init_process_group wraps whatever hook it finds: called before it, ours is the one
wrapped, and the line gets torch's "[rankN]: " prefix; still one line. Either that ends a thread other than the main
one is printed the same way by a hook in front of threading.excepthook (the thread ends; the process goes on, as
Python does for any exception in a thread).

megatron_app.install() (the drop-in for a user's own loop) calls it. The trainer (python -m megatron_app.train) does
not: its launcher reads the ranks' tracebacks and ends with one line of its own (train/run_ranks.py).
"""

from __future__ import annotations

import sys
import threading

from megatron_app.say import say

from .settings import AppConfigError

PREFIX = "megatron_app"
PEER_NAMING_WAIT_S = 2.0   # at exit, how long the transport may take to see the peer a collective met dead
_installed = threading.Event()   # process-wide by nature: sys.excepthook is the process's


def one_line(error: BaseException) -> str:
    """'megatron_app: rank R: AppConfigError: message' (no rank outside torch.distributed; a message that already
    begins with this rank does not say it twice)."""
    import torch.distributed as dist

    rank = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
    message = " ".join(str(error).split("\n"))
    if rank and message.startswith(rank):
        message = message[len(rank):]
    return f"{PREFIX}: {rank}{type(error).__name__}: {message}"


def _peer_faults() -> tuple:
    """The exception types that say another rank failed (a peer died or left, or never sent): only those of modules
    this process has loaded, so the hook imports nothing."""
    faults = []
    transport = sys.modules.get("megatron_app.transport")
    if transport is not None:
        faults += [transport.PeerDied, transport.TransportClosed, transport.TransportTimeout]
    executor = sys.modules.get("megatron_app.runtime.executor")
    if executor is not None:
        faults.append(executor.PipelineStallError)
    return tuple(faults)


def _refusals() -> tuple:
    """Our refusals: AppConfigError, and an untested megatron-core (a RuntimeError, with its way out)."""
    compat = sys.modules.get("megatron_app.megatron_compat")
    return (AppConfigError,) + ((compat.UnsupportedMegatronError,) if compat is not None else ())


def as_one_line(error: BaseException):
    """The exception to print as one line for `error` (itself, or the PeerDied naming the peer behind a collective
    that met a dead one), or None: `error` keeps its traceback."""
    if isinstance(error, _refusals()) or isinstance(error, _peer_faults()):
        return error
    if isinstance(error, RuntimeError) and "megatron_app.transport" in sys.modules:
        from .peer_gone import peer_behind

        return peer_behind(error, wait_s=PEER_NAMING_WAIT_S)
    return None


def install_excepthook() -> None:
    """Chain our hooks in front of sys.excepthook and threading.excepthook, once per process."""
    if _installed.is_set():
        return
    _installed.set()
    previous, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, value, traceback):
        said = as_one_line(value)
        if said is not None:
            say(one_line(said))
        else:
            previous(kind, value, traceback)

    def thread_excepthook(args):
        said = as_one_line(args.exc_value)
        if said is not None:
            where = f" (thread {args.thread.name})" if args.thread is not None else ""
            say(one_line(said) + where)
        else:
            previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
