"""Why a run stops early, said in one line: a loss or gradient that is not finite, or a Ctrl-C.

Non-finite values (Megatron-LM's --check-for-nan-in-loss-and-grad, on by default): after each iteration's backward and
before its optimizer step, every rank looks at its gradients (and the last stage at the loss), and all ranks agree in
one small all-reduce, so every rank stops on that same iteration, before the step would spread the NaN into the
weights. The lowest rank that saw one names it; the others exit quietly.

Ctrl-C: the terminal sends SIGINT to every rank (and torchrun sends it again); the loop turns the first into
TrainingInterrupted, which says where the run was and what is saved, and ignores the rest while it cleans up.

SIGTERM under --exit-signal-handler (Megatron-LM's; SLURM sends it before a job's time limit, and torchrun passes it
on): remembered, not obeyed at once. After each iteration the ranks agree in one all-reduce (any_rank) whether one got
it, and all save that iteration and stop, as after --exit-duration-in-mins.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_app.devices import collective_device


class NonFiniteError(RuntimeError):
    """A loss or gradient was not finite. ``report``: this rank is the one that says so (one line per job)."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


class TrainingInterrupted(Exception):
    """Ctrl-C during training. ``report``: this rank prints the line (the one that prints the iteration lines)."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


LOSS_BIT, GRAD_BIT = 1, 2


def _non_finite_gradients(chunks: List[torch.nn.Module]) -> List[str]:
    """Names of this rank's parameters whose gradient holds a NaN or an inf (one pass, one device sync)."""
    from .names import named_global_parameters

    from .optim import model_grad

    named = [(name, model_grad(param)) for chunk in chunks for name, param in named_global_parameters(chunk)
             if model_grad(param) is not None]
    if not named:
        return []
    finite = torch.stack([grad.isfinite().all() for _, grad in named])
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(named, finite.tolist()) if not ok]


def check_finite(iteration: int, loss: Optional[float], chunks: List[torch.nn.Module], device: str,
                 gradients: bool = True) -> None:
    """Raise NonFiniteError on every rank when any rank's loss or gradients are not finite (a collective).
    ``gradients=False``: the loss only (under a loss scale, overflowing gradients skip the step instead)."""
    bad_grads = _non_finite_gradients(chunks) if gradients else []
    bits = (LOSS_BIT if loss is not None and not math.isfinite(loss) else 0) | (GRAD_BIT if bad_grads else 0)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    seen = torch.zeros(world, dtype=torch.int32, device=collective_device())
    seen[rank] = bits
    if world > 1:
        dist.all_reduce(seen)
    offenders = [r for r, value in enumerate(seen.tolist()) if value]
    if not offenders:
        return
    what = []
    if bits & LOSS_BIT:
        what.append(f"the loss is {loss}")
    if bits & GRAD_BIT:
        what.append(f"{len(bad_grads)} gradient tensor{'s' if len(bad_grads) > 1 else ''} hold NaN or inf "
                    f"(first: {bad_grads[0]})")
    others = "" if len(offenders) == 1 else f" (ranks {', '.join(map(str, offenders))} saw one)"
    raise NonFiniteError(f"iteration {iteration}: {'; '.join(what) or 'not finite'}{others}; stopped before the "
                         "optimizer step (--no-check-for-nan-in-loss-and-grad keeps going)",
                         report=offenders[0] == rank)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "TransportClosed", "PeerDied")
INTERRUPT_GRACE_S = 2.0


class _CtrlC:
    """Whether this process's Ctrl-C came (set by raise_once_on_ctrl_c's handler). Kept apart from the exception:
    the KeyboardInterrupt can be raised where library code turns it into another error (a handler run from inside
    C++, as torch's waits do), and the rank then meets its peers' exits with no interrupt in hand."""
    seen = False


def ctrl_c_seen() -> bool:
    return _CtrlC.seen


def interrupt_follows(error: BaseException) -> bool:
    """Whether `error` is the shadow of a Ctrl-C: one already came to this rank (whatever became of its
    KeyboardInterrupt), or, for a peer that went away, one that has not reached this rank yet (torchrun passes SIGINT
    to its ranks one after another, and a rank blocked in a collective may see the first one exit before its own
    SIGINT arrives: waits up to INTERRUPT_GRACE_S for it). False for any other error."""
    if ctrl_c_seen():
        return True
    text = f"{type(error).__name__}: {error}"
    if not any(sign in text for sign in PEER_GONE):
        return False
    try:   # the handler raises into the sleep: no need to poll the record
        time.sleep(INTERRUPT_GRACE_S)
    except KeyboardInterrupt:
        return True
    return False


def any_rank(*flags: bool) -> List[bool]:
    """For each flag, whether any rank has it set: one collective for all of them, so every rank stops after the
    same iteration (Megatron-LM's all-reduce of its `done` flag)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    done = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=collective_device())
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return [bool(value) for value in done.tolist()]


class ExitSignal:
    """--exit-signal-handler: SIGTERM sets ``received`` instead of ending the process; restore() puts the previous
    handler back. Off the main thread (where no handler can be set) it does nothing."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self._previous = None

    def install(self) -> "ExitSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._remember)
        return self

    def _remember(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None


def raise_once_on_ctrl_c() -> Callable[[], None]:
    """From now on the first SIGINT raises KeyboardInterrupt and every later one is ignored: torchrun passes the
    terminal's Ctrl-C on to its ranks, so a rank gets it twice, and a second KeyboardInterrupt landing in the clean-up
    of the first would end in a traceback. Returns what restores the previous handler when no Ctrl-C came (nothing
    off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)

    def first_only(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _CtrlC.seen = True
        raise KeyboardInterrupt

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is first_only:   # after a Ctrl-C, later ones stay ignored until exit
            signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, first_only)
    return restore


def interrupted(iteration: Optional[int], iters: int, save_dir: Optional[str], saved: Optional[int],
                report: bool) -> TrainingInterrupted:
    """The exception for a Ctrl-C during `iteration` (None: before the first); further Ctrl-Cs are ignored from
    here on, so the clean-up that follows is not cut short by torchrun's own SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    where = "before the first iteration" if iteration is None else f"at iteration {iteration} of {iters}"
    if saved is not None:
        kept = f"nothing saved since iteration {saved}"
    elif save_dir:
        kept = f"nothing saved yet in {save_dir}"
    else:
        kept = "nothing saved (no --save)"
    return TrainingInterrupted(f"interrupted {where}; {kept}", report)
