"""runtime/one_line_errors.py: an uncaught AppConfigError (our refusals) ends a user's own script in one line naming
the rank and the fix, not a traceback; other exceptions keep theirs. Each case is a real interpreter (a hook only
acts at the top of one); the misbuilt loop under torchrun is in tests/test_simple_train_loop.py."""

import subprocess
import sys
import textwrap

import pytest

from pipeline_runs import REPO, run_env

REFUSAL = "pipeline rank 1's model chunk 0 was built with pre_process=True; build it with pre_process=..."


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=120)


def test_an_uncaught_refusal_is_one_line_and_exit_status_1():
    result = _python(f"""
        from megatron_app.runtime.one_line_errors import install_excepthook
        from megatron_app.runtime.settings import AppConfigError
        install_excepthook()
        install_excepthook()     # once: a second call changes nothing
        raise AppConfigError({REFUSAL!r})
    """)
    assert result.returncode == 1
    assert result.stderr == f"megatron_app: AppConfigError: {REFUSAL}\n"


def test_other_exceptions_keep_their_traceback():
    result = _python("""
        from megatron_app.runtime.one_line_errors import install_excepthook
        install_excepthook()
        raise ValueError("not ours")
    """)
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):") and "ValueError: not ours" in result.stderr


def test_under_torch_distributed_the_line_names_the_rank_whichever_hook_came_first():
    """torch.distributed.init_process_group wraps the hook it finds ("[rankN]: " before each line): installed before
    it, ours is wrapped and the line is prefixed; installed after, ours is in front. One line either way, and a
    message that already names this rank does not name it twice."""
    for before in (True, False):
        result = _python(f"""
            import torch.distributed as dist
            from megatron_app.runtime.one_line_errors import install_excepthook
            from megatron_app.runtime.settings import AppConfigError
            if {before}:
                install_excepthook()
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            install_excepthook()
            raise AppConfigError("rank 0: got 1 data iterators for 2 model chunks; pass one per chunk")
        """)
        line = "megatron_app: rank 0: AppConfigError: got 1 data iterators for 2 model chunks; pass one per chunk"
        assert result.returncode == 1
        assert result.stderr.strip() == (f"[rank0]: {line}" if before else line), result.stderr


def test_a_refusal_that_ends_a_thread_is_one_line_and_the_process_goes_on():
    result = _python(f"""
        import threading
        from megatron_app.runtime.one_line_errors import install_excepthook
        from megatron_app.runtime.settings import AppConfigError
        install_excepthook()

        def work():
            raise AppConfigError({REFUSAL!r})

        thread = threading.Thread(target=work, name="loader")
        thread.start()
        thread.join()
        print("main goes on")
    """)
    assert result.returncode == 0 and result.stdout == "main goes on\n"
    assert result.stderr == f"megatron_app: AppConfigError: {REFUSAL} (thread loader)\n"


def test_megatron_app_install_puts_the_hook_in_place():
    """The drop-in's install() (megatron_app.install) is what a user's loop calls: a bad argument is refused by it, and
    that refusal is already one line."""
    result = _python("""
        import megatron_app
        megatron_app.install(policy="no-such-policy")
    """)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("megatron_app: AppConfigError: unknown policy 'no-such-policy'; choose one of ")


@pytest.mark.parametrize("module,kind,message", [
    # another rank's failure
    ("megatron_app.transport", "PeerDied",
     "peer rank 1 closed its connection without a goodbye (its process exited or was killed)"),
    # an untested megatron-core (a RuntimeError, as an incompatible library is): our refusal with its way out
    ("megatron_app.megatron_compat", "UnsupportedMegatronError",
     "megatron-core 0.99.0 is untested; install(allow_untested_megatron=True) ..."),
])
def test_another_ranks_failure_and_an_untested_megatron_are_one_line_too(module, kind, message):
    result = _python(f"""
        from {module} import {kind}
        from megatron_app.runtime.one_line_errors import install_excepthook
        install_excepthook()
        raise {kind}({message!r})
    """)
    assert result.returncode == 1
    assert result.stderr == f"megatron_app: {kind}: {message}\n", result.stderr


def test_a_collective_that_met_a_dead_peer_names_the_peer_the_transport_saw_go():
    """The user's own all_reduce fails first with gloo's words; the transport's names the peer. Without a peer the
    transport saw go (or for any other RuntimeError) the traceback stays."""
    for known in (True, False):
        result = _python(f"""
            import megatron_app.runtime.job as job
            import megatron_app.transport   # a loop that ran our pipeline has it loaded
            from megatron_app.runtime import one_line_errors
            one_line_errors.PEER_NAMING_WAIT_S = 0.2
            gone = [(True, "peer rank 1 closed its connection without a goodbye")]
            job.peer_failures = lambda: gone if {known} else []
            one_line_errors.install_excepthook()
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:5: Connection reset by peer\\n"
                               "Exception raised from ...")
        """)
        assert result.returncode == 1
        if known:
            assert result.stderr == ("megatron_app: PeerDied: peer rank 1 closed its connection without a goodbye "
                                     "(a collective failed first: RuntimeError: [gloo/transport/tcp/pair.cc:534] "
                                     "Read error [10.0.0.2]:5: Connection reset by peer)\n"), result.stderr
        else:
            assert result.stderr.startswith("Traceback (most recent call last):"), result.stderr

