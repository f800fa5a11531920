"""A run that stops early says why in one line: a loss or gradient that is not finite, or a Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_app.train.stops import NonFiniteError, check_finite, interrupted
from pipeline_runs import REPO, read_until, run_env


def _chunk(grad_value: float) -> torch.nn.Module:
    chunk = torch.nn.Linear(2, 2)
    chunk.weight.grad = torch.full_like(chunk.weight, grad_value)
    chunk.bias.grad = torch.zeros_like(chunk.bias)
    return chunk


def test_finite_loss_and_gradients_pass():
    check_finite(3, 6.9, [_chunk(0.5)], "cpu")
    check_finite(3, None, [_chunk(0.5)], "cpu")    # not the last stage: no loss here


@pytest.mark.parametrize("loss, grad, fragments", [
    (float("nan"), 0.5, ["iteration 4: the loss is nan;", "--no-check-for-nan-in-loss-and-grad keeps going"]),
    (6.9, float("inf"), ["iteration 4: 1 gradient tensor hold NaN or inf (first: weight)"]),
])
def test_a_non_finite_loss_or_gradient_stops_with_one_line_naming_it(loss, grad, fragments):
    with pytest.raises(NonFiniteError) as info:
        check_finite(4, loss, [_chunk(grad)], "cpu")
    assert info.value.report and "\n" not in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_interruption_line_says_what_is_saved():
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert str(interrupted(7, 10, None, None, True)) == "interrupted at iteration 7 of 10; nothing saved (no --save)"
        assert str(interrupted(7, 10, "ckpt", 5, True)) == "interrupted at iteration 7 of 10; nothing saved since " \
                                                           "iteration 5"
        assert str(interrupted(None, 10, "ckpt", None, False)) == "interrupted before the first iteration; nothing " \
                                                                  "saved yet in ckpt"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN   # torchrun's second SIGINT cannot cut the clean-up
    finally:
        signal.signal(signal.SIGINT, previous)


def _train(*flags, timeout=240):
    return subprocess.run([sys.executable, "-m", "megatron_app.train", "--iters", "3", "--num-layers", "2",
                           "--no-trace", *flags], cwd=REPO, env=run_env(WORLD_SIZE="1"), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_a_diverging_run_stops_on_the_iteration_it_diverges():
    done = _train("--lr", "1e20")   # Adam's first step at this rate breaks the weights: iteration 2 is NaN
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [line for line in done.stderr.splitlines() if line.startswith("megatron_app.train: rank 0: ")]
    assert len(errors) == 1 and "iteration 2: the loss is nan" in errors[0], done.stderr
    assert "iter 1/3" in done.stdout and "iter 2/3" not in done.stdout


@pytest.mark.slow
def test_ctrl_c_ends_in_one_line_without_a_traceback_or_a_failure_line(tmp_path):
    launcher = subprocess.Popen(
        ["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--iters", "400", "--num-layers", "2",
         "--no-trace", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"], cwd=REPO,
        env=run_env(LOG_DIR=str(tmp_path / "logs")), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        read_until(launcher, "iter 2/400")
        os.killpg(launcher.pid, signal.SIGINT)    # what the terminal does on Ctrl-C: the whole process group
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "failed" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "megatron_app.train: interrupted at iteration " in last and "of 400; nothing saved since iteration " \
        in last, last


def test_a_collective_that_met_a_dead_peer_names_the_peer_the_transport_saw_die():
    from megatron_app.runtime.peer_gone import peer_behind
    from megatron_app.transport import PeerDied

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:5: "
                        "Connection reset by peer\nException raised from ...")
    why = "peer rank 1 (10.0.0.2:4000) closed its connection without a goodbye (its process exited or was killed)"
    told = [(True, why)]
    named = peer_behind(gloo, lambda: told, wait_s=0.1)
    assert isinstance(named, PeerDied)
    assert str(named).startswith(why) and "\n" not in str(named)
    assert "a collective failed first: RuntimeError: [../third_party" in str(named)
    # the transport may notice a moment after the collective failed
    calls = []
    late = peer_behind(gloo, lambda: calls.append(1) or (told if len(calls) > 3 else []), wait_s=5.0)
    assert isinstance(late, PeerDied) and len(calls) == 4
    # nothing known: the original error stands (after the wait); another error is not a peer's
    assert peer_behind(gloo, lambda: [], wait_s=0.1) is None
    assert peer_behind(ValueError("shape mismatch"), lambda: told) is None
    assert peer_behind(PeerDied("already named"), lambda: told) is None
    # a peer that closed its transport cleanly (it ended, or was interrupted) is not said to have died
    closed = peer_behind(gloo, lambda: [(False, "peer rank 1 closed its transport")], wait_s=0.1)
    assert type(closed).__name__ == "TransportClosed" and str(closed).startswith("peer rank 1 closed its transport")


def test_the_first_ctrl_c_raises_and_the_ones_after_it_are_ignored():
    """torchrun passes the terminal's Ctrl-C on to its ranks: a rank gets it twice, and the second must not interrupt
    the first one's clean-up. Without a Ctrl-C, the previous handler comes back."""
    code = textwrap.dedent("""
        import os, signal, time
        from megatron_app.train.stops import raise_once_on_ctrl_c
        signal.signal(signal.SIGINT, signal.default_int_handler)   # a suite started with `nohup ... &` ignores it
        restore = raise_once_on_ctrl_c()
        restore()                               # no Ctrl-C: Python's own handler is back
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        restore = raise_once_on_ctrl_c()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("first raised")
        os.kill(os.getpid(), signal.SIGINT)     # the second: ignored
        time.sleep(0.2)
        # the interrupt is remembered even where its KeyboardInterrupt was turned into another error: a peer's
        # exit met afterwards (or any error) is the Ctrl-C's, at once
        from megatron_app.train.stops import interrupt_follows
        started = time.monotonic()
        print(interrupt_follows(RuntimeError("Connection closed by peer")), time.monotonic() - started < 0.5)
        restore()                               # after a Ctrl-C later ones stay ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        print("cleaned up")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=run_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.split() == ["True", "first", "raised", "True", "True", "cleaned", "up"], \
        result.stdout + result.stderr
