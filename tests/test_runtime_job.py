"""The runtime's per-job context (runtime/job.py): what a job needs lives on its AppJob, not in module globals."""

import ast
import pathlib

import pytest

import megatron_app.runtime as runtime
from megatron_app.runtime.job import AppJob, current_job

RUNTIME = pathlib.Path(runtime.__file__).parent


def test_no_runtime_module_rebinds_a_global_but_the_current_job_holder():
    rebinding = {path.name for path in RUNTIME.glob("*.py")
                 if any(isinstance(node, ast.Global) for node in ast.walk(ast.parse(path.read_text())))}
    assert rebinding == {"job.py"}


def test_what_one_job_is_told_for_its_next_call_stays_with_that_job():
    told, other = AppJob(), AppJob()
    told.next_call.set_lengths([4, 9])
    assert other.next_call.take_lengths(2) is None
    assert told.next_call.take_lengths(2) == (4, 9) and told.next_call.take_lengths(2) is None


def test_the_public_functions_act_on_the_current_job():
    job = current_job()
    runtime.set_microbatch_lengths([3, 5, 7])
    assert job.next_call.lengths == (3, 5, 7)
    assert runtime.take_microbatch_lengths(3) == (3, 5, 7) and job.next_call.lengths is None
    wrapper = lambda transport, ranks: transport  # noqa: E731
    runtime.add_transport_wrapper(wrapper)
    try:
        assert job.transport_wrappers[-1] is wrapper
    finally:
        runtime.remove_transport_wrapper(wrapper)
    assert wrapper not in job.transport_wrappers


def test_shutdown_closes_the_session_and_keeps_the_job():
    job = current_job()
    session = job.session
    runtime.shutdown()
    assert job.open_session is None and session._closed and current_job() is job
    assert runtime.current_tracer() is None


def test_install_keeps_megatron_originals_in_the_jobs_record_and_uninstall_puts_them_back():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    from megatron_app.runtime import linear_wgrad

    before = schedules.forward_backward_pipelining_without_interleaving
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    linear_before = linear.backward
    job = current_job()
    runtime.install()
    try:
        assert runtime.is_installed() and job.installation.schedule_functions[
            "forward_backward_pipelining_without_interleaving"] is before
        assert schedules.forward_backward_pipelining_without_interleaving is runtime.forward_backward_app
        linear_wgrad.install(job.installation)
        assert job.installation.linear_backward is linear_before and linear.backward is not linear_before
    finally:
        runtime.uninstall()
    assert not runtime.is_installed() and job.installation.linear_backward is None
    assert schedules.forward_backward_pipelining_without_interleaving is before and linear.backward is linear_before


@pytest.fixture(autouse=True)
def _closed_session():
    yield
    runtime.shutdown()


def test_trace_iterations_count_from_one_and_follow_the_loops_number():
    from megatron_app.trace.schema import FIRST_ITERATION

    job = AppJob()
    assert FIRST_ITERATION == 1
    assert [job.trace_iteration(calls) for calls in (0, 1, 2)] == [1, 2, 3]   # untold: calls counted from 1
    job.tell_iteration(4)          # a run resumed after iteration 3: its first call is the log's iteration 4
    assert [job.trace_iteration(calls) for calls in (0, 1)] == [4, 5]
